"""tools/collector_pauses.py: a burst of created files through a fresh mount, and what the
cycle collector cost during it and once the mount was quiet (docs/benchmarks.md, "The cycle
collector"; acpfs/daemon/collector.py).

    .venv/bin/python tools/collector_pauses.py [--files N] [--quiet S]   # as root

Prints the burst's time, its slowest create+write+close of a 4 KiB file, the status's
``collector`` after the burst and after S seconds of quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

PY = sys.executable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=30000)
    ap.add_argument("--quiet", type=float, default=12.0, help="seconds without requests after")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="acpfs-collector-")
    mnt, back = os.path.join(tmp, "mnt"), os.path.join(tmp, "back")
    os.makedirs(mnt)
    os.makedirs(back)
    cache = tempfile.mkdtemp(prefix="acpfs-collector-cache-", dir="/dev/shm")
    subprocess.run([PY, "-m", "acpfs", "mount", mnt, "--backing", back, "--cache-dir", cache,
                    "--cache-size", "4G"], check=True, capture_output=True)

    def collector() -> dict:
        out = subprocess.run([PY, "-m", "acpfs", "status", "--json", mnt], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out)["collector"]
    try:
        os.makedirs(os.path.join(mnt, "d"))
        data = b"x" * 4096
        slowest = 0.0
        start = time.perf_counter()
        for i in range(a.files):
            t = time.perf_counter()
            fd = os.open(os.path.join(mnt, "d", f"f{i:07}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644)
            os.write(fd, data)
            os.close(fd)
            slowest = max(slowest, time.perf_counter() - t)
        took = time.perf_counter() - start
        during = collector()
        print(f"{a.files} files in {took:.1f} s ({a.files / took:.0f}/s); slowest "
              f"create+write+close {slowest * 1e3:.1f} ms")
        print("collector after the burst:", json.dumps(during))
        time.sleep(a.quiet)
        print(f"collector after {a.quiet:g} s of quiet:", json.dumps(collector()))
    finally:
        subprocess.run([PY, "-m", "acpfs", "umount", mnt], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
