"""tools/passthrough_floor.py: what a load of a file the cache does not hold costs through FUSE
at best, beside what it costs through acpfs.

Builds tools/passthrough_floor.c (a C daemon that passes every open through to the file in a
directory and answers everything else at once: nothing cached, nothing checked) and mounts it,
its Python twin tools/passthrough_floor_py.py (the same requests, answered by Python on
acpfs's own transport: pyfuse3, trio and acpfs's C extension) and acpfs over one backing
directory. Each round writes a checkpoint into a new directory of
the backing (as another node would), reads it there once (so both read a warm page cache, as
``tools/bench --workloads cold`` does), and runs each loader on the backing file directly,
through the floors and through acpfs, side by side in one process (the three mounts in
rotating order). Ratios are the direct load's time over the mount's (higher is better,
1.0 = as fast as the backing): the C floor's ratio is what this kernel and machine allow any
daemon; the Python floor's, what any daemon written as acpfs is (Python on pyfuse3) allows;
acpfs's distance below that is what its own handling of the requests costs.

    .venv/bin/python tools/passthrough_floor.py [--size MIB] [--rounds N]   # as root
        [--pin none|same|apart] [--io-uring LIBFUSE_BUILD]

``--io-uring`` builds the C floor against a libfuse 3.18+ build directory (meson's, from
libfuse's sources: its headers under include/ and lib/, the library in lib/) and serves it
over FUSE-over-io_uring (the fuse module's ``enable_uring`` is set for the run and put back).

Also prints the FUSE requests acpfs saw per load (``status``'s ``requests``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


URING = "/sys/module/fuse/parameters/enable_uring"


def build(tmp: str, libfuse: str | None) -> str:
    """The C floor, against the system's libfuse or (io_uring) a libfuse 3.18+ build."""
    exe = os.path.join(tmp, "passthrough-floor")
    if libfuse is None:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                               capture_output=True, text=True).stdout.split()
    else:
        flags = ["-DFUSE_USE_VERSION=318", f"-I{libfuse}", f"-I{libfuse}/lib",
                 f"-I{os.path.dirname(os.path.abspath(libfuse))}/include", f"-L{libfuse}/lib",
                 f"-Wl,-rpath,{os.path.abspath(libfuse)}/lib", "-lfuse3", "-lpthread"]
    subprocess.run(["cc", "-O2", "-o", exe, os.path.join(REPO, "tools", "passthrough_floor.c"),
                    *flags], check=True)
    return exe


def wait_mounted(path: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + 20
    while not os.path.ismount(path):
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise SystemExit(f"passthrough_floor: {path} did not mount")
        time.sleep(0.05)


def load_torch(path: str) -> None:
    sd = torch.load(path, mmap=True, weights_only=True)
    for t in sd.values():
        t.view(torch.uint8)[::4096].sum()


def load_np(path: str) -> None:
    a = np.memmap(path, dtype=np.uint8, mode="r")
    int(a[::4096].sum())
    del a


def load_read(path: str) -> None:
    buf = bytearray(8 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


LOADERS = {"torch.load(mmap=True) + touch": load_torch, "np.memmap + touch": load_np,
           "read() in 8 MiB pieces": load_read}


def timed(fn, path: str) -> float:
    t = time.perf_counter()
    fn(path)
    return time.perf_counter() - t


def status(mnt: str) -> dict:
    out = subprocess.run([PY, "-m", "acpfs", "status", "--json", mnt], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def requests(mnt: str) -> dict:
    return status(mnt)["requests"]


def settle(mnt: str) -> None:
    """Untimed: until acpfs has made the copies it keeps of files read (they would take CPU
    and memory bandwidth from the next load), then past the coherence timeout, as between a
    save and a load."""
    deadline = time.monotonic() + 300
    while status(mnt)["cold_reads"]["keeping"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1024, help="MiB per checkpoint (default 1024)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--pin", choices=["none", "same", "apart"], default="none",
                    help="daemons and this process on CPU 0 (same), the daemons on CPU 1 and "
                         "this process on CPU 0 (apart), or where the kernel puts them (none)")
    ap.add_argument("--io-uring", metavar="LIBFUSE_BUILD",
                    help="the C floor over FUSE-over-io_uring, built against this libfuse 3.18+ "
                         "build directory (meson's)")
    args = ap.parse_args()
    uring_was = None
    if args.io_uring:
        with open(URING) as f:
            uring_was = f.read().strip()
        with open(URING, "w") as f:
            f.write("Y")
    tmp = tempfile.mkdtemp(prefix="acpfs-ptfloor-")
    back, floor_mnt, py_mnt, acpfs_mnt = (os.path.join(tmp, d)
                                          for d in ("back", "floor", "pyfloor", "acpfs"))
    for d in (back, floor_mnt, py_mnt, acpfs_mnt):
        os.makedirs(d)
    cache = tempfile.mkdtemp(prefix="acpfs-ptfloor-cache-", dir="/dev/shm")
    floor = pyfloor = None
    mounted = False
    try:
        floor = subprocess.Popen([build(tmp, args.io_uring), floor_mnt, back]
                                 + (["io_uring"] if args.io_uring else []))
        wait_mounted(floor_mnt, floor)
        pyfloor = subprocess.Popen([PY, os.path.join(REPO, "tools", "passthrough_floor_py.py"),
                                    py_mnt, back], cwd=REPO)
        wait_mounted(py_mnt, pyfloor)
        subprocess.run([PY, "-m", "acpfs", "mount", acpfs_mnt, "--backing", back, "--cache-dir",
                        cache, "--cache-size", f"{2 * args.size + 512}M"], check=True,
                       capture_output=True)
        mounted = True
        if args.pin != "none":
            daemon_cpu = {0} if args.pin == "same" else {1}
            # over io_uring libfuse pins each queue's thread to its CPU: left where it is
            daemons = [pyfloor.pid, status(acpfs_mnt)["pid"]] + ([] if args.io_uring else [floor.pid])
            for pid in daemons:
                for tid in os.listdir(f"/proc/{pid}/task"):   # every thread, as taskset -a
                    os.sched_setaffinity(int(tid), daemon_cpu)
            os.sched_setaffinity(0, {0})
        sd = {"w": torch.zeros((args.size << 20) // 4)}
        kinds = ("direct", "floor", "pyfloor", "acpfs")
        times: dict[str, dict[str, list[float]]] = {k: {kind: [] for kind in kinds}
                                                    for k in LOADERS}
        per_load: dict[str, float] = {}
        for r in range(args.rounds):
            for i, (name, fn) in enumerate(LOADERS.items()):
                rel = f"r{r}/f{i}.pt"
                os.makedirs(os.path.join(back, f"r{r}"), exist_ok=True)
                with open(os.path.join(back, rel), "wb") as f:
                    torch.save(sd, f)
                    f.flush()
                    os.fsync(f.fileno())
                fn(os.path.join(back, rel))                      # untimed: a warm page cache
                settle(acpfs_mnt)
                fn(os.path.join(back, rel))                      # untimed: warm code paths
                times[name]["direct"].append(timed(fn, os.path.join(back, rel)))
                order = [("floor", floor_mnt), ("pyfloor", py_mnt), ("acpfs", acpfs_mnt)]
                for kind, mnt in order[r % 3:] + order[:r % 3]:
                    before = requests(acpfs_mnt) if kind == "acpfs" else None
                    times[name][kind].append(timed(fn, os.path.join(mnt, rel)))
                    if before is not None and i == 0:
                        after = requests(acpfs_mnt)
                        for k, v in after.items():
                            if k != "getxattr" and v != before.get(k, 0):
                                per_load[k] = per_load.get(k, 0) + (v - before.get(k, 0)) / args.rounds
        print(f"{args.size} MiB, medians of {args.rounds} rounds, pinned: {args.pin}, "
              f"C floor over {'io_uring' if args.io_uring else '/dev/fuse'}; "
              "ratio = direct time / mount time")
        print(f"{'loader':31s} {'direct ms':>9s} {'C ms':>8s} {'Py ms':>8s} "
              f"{'acpfs ms':>8s} {'C floor':>8s} {'Py floor':>8s} {'acpfs':>6s}")
        for name, t in times.items():
            d, f, p, a = (statistics.median(t[k]) for k in kinds)
            print(f"{name:31s} {d * 1e3:9.2f} {f * 1e3:8.2f} {p * 1e3:8.2f} {a * 1e3:8.2f} "
                  f"{d / f:7.2f}x {d / p:7.2f}x {d / a:5.2f}x")
        print("acpfs requests per torch.load (status):",
              ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_load.items())))
    finally:
        if mounted:
            subprocess.run([PY, "-m", "acpfs", "umount", acpfs_mnt], capture_output=True)
        for proc, mnt in ((floor, floor_mnt), (pyfloor, py_mnt)):
            if proc is not None:
                subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
                proc.wait(timeout=20)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        if uring_was is not None:
            with open(URING, "w") as f:
                f.write(uring_was)


if __name__ == "__main__":
    main()
