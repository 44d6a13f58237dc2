"""Summarize py-spy raw (collapsed-stack) profiles written by `tools/bench --profile`.

    .venv/bin/python tools/bench_profile.py PROFILE.txt [--top N] [--filter acpfs]

Prints, per thread and overall, the functions with the most samples on CPU: "self" counts
samples where the function is the innermost frame, "incl" where it is anywhere on the stack
(counted once per sample). Percentages are of all non-idle samples.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")


def short(frame: str) -> str:
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    for key in ("/acpfs/", "/site-packages/", "/lib/python3"):
        if key in f:
            f = f.split(key, 1)[1]
            if key == "/acpfs/":
                f = "acpfs/" + f
            break
    return f"{m.group('func')} ({f})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--filter", default="", help="only frames whose text contains this, for 'incl'")
    a = ap.parse_args()
    selfc: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    total = 0
    for path in a.files:
        with open(path) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line:
                    continue
                stack, _, n = line.rpartition(" ")
                try:
                    n = int(n)
                except ValueError:
                    continue
                frames = stack.split(";")
                thread = next((fr for fr in frames if fr.startswith("thread ")), "?")
                frames = [fr for fr in frames if not fr.startswith(("thread ", "process "))]
                total += n
                threads[thread] += n
                if frames:
                    selfc[short(frames[-1])] += n
                for fr in set(short(x) for x in frames):
                    if a.filter in fr:
                        incl[fr] += n
    if not total:
        print("no samples")
        return 1
    print(f"{total} samples")
    print("threads:")
    for t, n in threads.most_common(8):
        print(f"  {100 * n / total:5.1f}%  {t}")
    print("self:")
    for fr, n in selfc.most_common(a.top):
        print(f"  {100 * n / total:5.1f}%  {fr}")
    print("inclusive:")
    for fr, n in incl.most_common(a.top):
        print(f"  {100 * n / total:5.1f}%  {fr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
