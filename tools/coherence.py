"""What close-to-open coherence costs one node: the same workloads with the checks on
(``--coherence-timeout 1``, the default) and off (``--coherence-timeout 1e9``), side by side.

    ./tools/coherence [--files 3000] [--reps 3] [--read-mb 256]

Workloads, each on a fresh mount over a fresh backing under /tmp: create ``--files`` small
files in one directory (each a LOOKUP that misses, then a create), ``acpfs sync``, then stat
them all after the kernel's attribute timeout (each a LOOKUP and GETATTR that may compare with
the backing), and read a cached ``--read-mb`` file after that timeout (an open that compares
the file with the backing). Prints medians and the ratio on/off (docs/benchmarks.md).
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


def one(timeout_s: float, files: int, read_mb: int) -> tuple[float, float, float]:
    work = tempfile.mkdtemp(prefix="acpfs-coherence-")
    mnt, back = os.path.join(work, "m"), os.path.join(work, "b")
    os.mkdir(mnt)
    os.mkdir(back)
    subprocess.run(ACPFS + ["mount", mnt, "--backing", back, "--cache-size", f"{read_mb * 2 + 64}M",
                            "--cache-dir", os.path.join(work, "cache"), "--log-file",
                            os.path.join(work, "log"), "--coherence-timeout", str(timeout_s)],
                   check=True, capture_output=True)
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
        with open(big, "rb") as f:
            while f.read(1 << 20):
                pass
        read = time.monotonic() - start
        return create, stat, read
    finally:
        subprocess.run(ACPFS + ["umount", mnt], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-mb", type=int, default=256)
    a = ap.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {"on": [], "off": []}
    for _ in range(a.reps):                  # interleaved: the machine's noise hits both
        runs["on"].append(one(1.0, a.files, a.read_mb))
        runs["off"].append(one(1e9, a.files, a.read_mb))
    med = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in runs.items()}
    print(f"{'workload':28} {'checks on':>10} {'off':>10} {'on/off':>7}")
    for i, what in enumerate((f"create {a.files} files", f"stat {a.files} files",
                              f"read cached {a.read_mb} MiB")):
        print(f"{what:28} {med['on'][i]:9.3f}s {med['off'][i]:9.3f}s {med['on'][i] / med['off'][i]:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
