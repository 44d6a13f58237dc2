"""What close-to-open coherence costs one node, side by side in one run (docs/benchmarks.md).

    ./tools/coherence [--files 3000] [--reps 3] [--read-mb 256] [--against CHECKOUT]

Without ``--against``: the same workloads with the timed checks on (``--coherence-timeout
1``, the default) and off (``--coherence-timeout 1e9``); the checks every open and every
miss make are in both. With ``--against CHECKOUT`` (another checkout of acpfs, built: e.g.
``git worktree add /tmp/old <rev> && (cd /tmp/old && ../main/.venv/bin/pip install -e .)``, or
just its in-place ``acpfs/_fastwrite*.so`` built): this checkout against that one, both with
the default timeout, so the cost of the checks one revision added shows.

Workloads, each on a fresh mount over a fresh backing under /tmp: create ``--files`` small
files in one directory (each a LOOKUP that misses, then a create), ``acpfs sync``, then stat
them all after the kernel's attribute timeout (each a LOOKUP and GETATTR that may compare with
the backing), open and read each of them again (each open compares the file with the
backing), and read a cached ``--read-mb`` file (an open that compares). Prints medians and
the ratio of the two.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ACPFS = [sys.executable, "-m", "acpfs"]


WORKLOADS = ("create {files} files", "stat {files} files", "open+read {files} files",
             "read cached {read_mb} MiB")


def one(timeout_s: float, files: int, read_mb: int, code: str | None = None) -> tuple[float, ...]:
    work = tempfile.mkdtemp(prefix="acpfs-coherence-")
    mnt, back = os.path.join(work, "m"), os.path.join(work, "b")
    os.mkdir(mnt)
    os.mkdir(back)
    env = dict(os.environ, PYTHONPATH=code) if code else None
    subprocess.run(ACPFS + ["mount", mnt, "--backing", back, "--cache-size", f"{read_mb * 2 + 64}M",
                            "--cache-dir", os.path.join(work, "cache"), "--log-file",
                            os.path.join(work, "log"), "--coherence-timeout", str(timeout_s)],
                   check=True, capture_output=True, env=env)
    try:
        d = os.path.join(mnt, "d")
        os.mkdir(d)
        start = time.monotonic()
        for i in range(files):
            with open(os.path.join(d, f"f{i}"), "wb") as f:
                f.write(b"x" * 100)
        create = time.monotonic() - start
        big = os.path.join(mnt, "big")
        with open(big, "wb") as f:
            f.write(os.urandom(1 << 20) * read_mb)
        subprocess.run(ACPFS + ["sync", mnt], check=True, capture_output=True)
        time.sleep(5.5)                      # past the kernel's attribute and entry timeouts
        start = time.monotonic()
        for i in range(files):
            os.stat(os.path.join(d, f"f{i}"))
        stat = time.monotonic() - start
        start = time.monotonic()
        for i in range(files):
            with open(os.path.join(d, f"f{i}"), "rb") as f:
                f.read()
        reopen = time.monotonic() - start
        start = time.monotonic()
        with open(big, "rb") as f:
            while f.read(1 << 20):
                pass
        read = time.monotonic() - start
        return create, stat, reopen, read
    finally:
        subprocess.run(ACPFS + ["umount", mnt], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-mb", type=int, default=256)
    ap.add_argument("--against", metavar="CHECKOUT", help="another checkout of acpfs to compare with")
    a = ap.parse_args()
    if a.against and not os.path.isfile(os.path.join(a.against, "acpfs", "__init__.py")):
        print(f"coherence: {a.against} is not a checkout of acpfs", file=sys.stderr)
        return 2
    names = ("this", "against") if a.against else ("checks on", "off")
    runs: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
    for _ in range(a.reps):                  # interleaved: the machine's noise hits both
        runs[names[0]].append(one(1.0, a.files, a.read_mb))
        if a.against:
            runs[names[1]].append(one(1.0, a.files, a.read_mb, os.path.abspath(a.against)))
        else:
            runs[names[1]].append(one(1e9, a.files, a.read_mb))
    med = {k: [statistics.median(r[i] for r in v) for i in range(len(WORKLOADS))] for k, v in runs.items()}
    print(f"{'workload':28} {names[0]:>10} {names[1]:>10} {'ratio':>7}")
    for i, what in enumerate(WORKLOADS):
        what = what.format(files=a.files, read_mb=a.read_mb)
        x, y = med[names[0]][i], med[names[1]][i]
        print(f"{what:28} {x:9.3f}s {y:9.3f}s {x / y:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
