"""A/B speed check of acpfs daemon variants, side by side with /dev/shm, in one run.

    ./tools/ab [--size-mb 1024] [--reps 7] NAME=ENV[,ENV...] ...

Each NAME=ENV mounts acpfs with the given environment for its daemon (``-`` for none),
e.g. ``fast=- slow=ACPFS_NO_FAST_WRITE=1``. Every repetition runs torch.save, torch.load
and ``dd bs=1M`` against /dev/shm and then each mount, interleaved; after each write the
mount is synced (untimed) so that a background upload never overlaps the next
measurement. The first repetition is a warm-up; the table gives medians and each
variant's ratio to /dev/shm. Backings go under /tmp (a disk here) unless --backing-dir
says otherwise (/dev/shm takes the disk out of the measurement). This is how the speed decisions in docs/design.md were
measured; tools/bench is the full benchmark.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ACPFS = [sys.executable, "-m", "acpfs"]


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, sep, envs = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"ab: bad variant {text!r}: use NAME=VAR=VALUE[,VAR=VALUE] or NAME=-")
    env: dict[str, str] = {}
    if envs != "-":
        for item in envs.split(","):
            k, sep, v = item.partition("=")
            if not sep:
                raise SystemExit(f"ab: bad variable {item!r} in {text!r}")
            env[k] = v
    return name, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="NAME=VAR=VALUE[,VAR=VALUE] or NAME=-")
    ap.add_argument("--size-mb", type=int, default=1024, help="state dict size (default 1024)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions incl. warm-up (default 7)")
    ap.add_argument("--backing-dir", default=None,
                    help="where the mounts' backing directories go (default: under /tmp)")
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants]
    if a.reps < 2:
        raise SystemExit("ab: --reps must be at least 2 (the first is a warm-up)")
    import torch

    work = tempfile.mkdtemp(prefix="acpfs-ab-")
    backs = tempfile.mkdtemp(prefix="acpfs-ab-", dir=a.backing_dir) if a.backing_dir else work
    shm = tempfile.mkdtemp(prefix="acpfs-ab-", dir="/dev/shm")
    cache_size = f"{a.size_mb * 3}M"
    targets = {"shm": shm}
    mounted = []
    try:
        for name, env in variants:
            mnt, back = os.path.join(work, name), os.path.join(backs, f"{name}-backing")
            os.makedirs(mnt)
            os.makedirs(back)
            subprocess.run([*ACPFS, "mount", mnt, "--backing", back, "--cache-size", cache_size,
                            "--cache-dir", os.path.join(shm, f"{name}-cache"),
                            "--log-file", os.path.join(work, f"{name}.log")],
                           env={**os.environ, **env}, check=True, capture_output=True)
            mounted.append(mnt)
            targets[name] = mnt
        n = 16
        sd = {f"t{i}": torch.randn((a.size_mb << 20) // n // 4) for i in range(n)}
        nbytes = sum(t.numel() * 4 for t in sd.values())
        res: dict[str, list[float]] = {}

        def timed(key: str, fn) -> None:
            t0 = time.perf_counter()
            fn()
            res.setdefault(key, []).append(nbytes / (time.perf_counter() - t0) / 1e9)

        def settle(d: str) -> None:
            if d != shm:
                subprocess.run([*ACPFS, "sync", d], check=True, capture_output=True)

        for rep in range(a.reps):
            for name, d in targets.items():
                p = os.path.join(d, "model.pt")
                timed(f"save {name}", lambda: torch.save(sd, p))
                settle(d)
                timed(f"load {name}", lambda: torch.load(p))
                os.unlink(p)
                dd = os.path.join(d, "dd")
                timed(f"dd {name}", lambda: subprocess.run(
                    ["dd", "if=/dev/zero", f"of={dd}", "bs=1M", f"count={nbytes >> 20}"],
                    check=True, capture_output=True))
                os.unlink(dd)
                settle(d)
            print(f"ab: repetition {rep + 1}/{a.reps} done", file=sys.stderr)
        print(f"{nbytes / 2**30:.2f} GiB state dict, {a.reps - 1} measured repetitions, GB/s")
        print(f"{'workload':10s}" + "".join(f"{name:>14s}" for name in targets))
        for w in ("save", "load", "dd"):
            med = {name: statistics.median(res[f"{w} {name}"][1:]) for name in targets}
            print(f"{w:10s}" + "".join(
                f"{med[name]:8.2f}" + (f" {med[name] / med['shm']:4.2f}x" if name != "shm" else " " * 6)
                for name in targets))
        print("samples (warm-up first):")
        for key in sorted(res):
            print(f"  {key:18s} " + " ".join(f"{x:.2f}" for x in res[key]))
        return 0
    finally:
        for mnt in mounted:
            subprocess.run([*ACPFS, "umount", mnt], capture_output=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(backs, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
