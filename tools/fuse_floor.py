"""tools/fuse_floor.py: the fastest a FUSE daemon can answer small-file requests here.

Mounts two filesystems that keep nothing but names and sizes and answer every request at
once (no cache, no journal, no backing): one in pyfuse3 + trio (``Floor`` below) and its
twin in C on libfuse's low-level API (tools/fuse_floor.c, built here with cc). On each and
on a /dev/shm directory it creates, writes 4 KiB into and closes N files, stats them and
removes them, as ``tools/bench --workloads small`` does, and prints the rates side by side.
The Python floor is the ceiling of acpfs's small-file figures while requests are answered
in Python; the C floor is the ceiling of any FUSE daemon on this kernel and machine, since
it pays only the kernel's round trips (docs/benchmarks.md).

Where the daemon runs against the program changes a round trip tenfold on a VM (a daemon
woken on another vCPU pays an IPI and, with halt polling off, a VM exit), so each round
measures three placements, interleaved:

- ``unpinned``: both where the scheduler puts them (what users get);
- ``same``: the program and the daemon's serving thread on one CPU;
- ``apart``: the program on one CPU, the daemon on another (skipped on one CPU).

/dev/shm runs with the program placed as in the round, and each ratio is taken within its
round; the table shows medians over the rounds and their range.

    .venv/bin/python tools/fuse_floor.py [N] [--rounds R] [--placements unpinned,same,apart]
    # as root; N files (default 2000), R rounds (default 3)
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import pyfuse3
import trio

from bench_worker import small_files   # tools/ is this script's directory

ROOT = pyfuse3.ROOT_INODE


class Floor(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[bytes, int] = {}
        self.sizes: dict[int, int] = {}
        self.next = ROOT + 1

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = (stat.S_IFDIR | 0o755) if ino == ROOT else (stat.S_IFREG | 0o644)
        a.st_nlink = 2 if ino == ROOT else 1
        a.st_size = self.sizes.get(ino, 0)
        a.entry_timeout = a.attr_timeout = 1.0
        a.st_blksize = 4096
        return a

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        ino = self.names.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def create(self, parent_inode, name, mode, flags, ctx):
        ino = self.next
        self.next += 1
        self.names[name] = ino
        self.sizes[ino] = 0
        return pyfuse3.FileInfo(fh=ino), self._attr(ino)

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode)

    async def write(self, fh, off, buf):
        self.sizes[fh] = max(self.sizes[fh], off + len(buf))
        return len(buf)

    async def flush(self, fh):
        pass

    async def release(self, fh):
        pass

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def unlink(self, parent_inode, name, ctx):
        ino = self.names.pop(name)
        self.sizes.pop(ino, None)

    async def opendir(self, inode, ctx):
        return inode

    async def releasedir(self, fh):
        pass


def workload(path: str, n: int) -> tuple[float, float, float]:
    """Files/s of create+write+close, stat and unlink (tools/bench's small-file workload)."""
    t = small_files(path, n, b"x" * 4096)
    return n / t["create_s"], n / t["stat_s"], n / t["unlink_s"]


def build_c(tmp: str) -> str:
    """tools/fuse_floor.c compiled under ``tmp``: the executable's path. Raises
    RuntimeError with the reason (no cc, no libfuse3 headers) where it cannot be built."""
    exe = os.path.join(tmp, "fuse-floor-c")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuse_floor.c")
    try:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                               capture_output=True, text=True).stdout.split()
        subprocess.run(["cc", "-O2", "-o", exe, src, *flags], check=True,
                       capture_output=True, text=True)
    except FileNotFoundError as e:
        raise RuntimeError(f"cannot build the C floor: {e.filename} is missing") from None
    except subprocess.CalledProcessError as e:
        why = (e.stderr or "").strip().splitlines()
        raise RuntimeError(f"cannot build the C floor: {' '.join(e.cmd[:2])} failed"
                           + (f": {why[-1]}" if why else "")) from None
    return exe


class CFloor:
    """The C floor mounted at ``mnt`` (a process of its own) until ``stop``."""

    def __init__(self, exe: str, mnt: str) -> None:
        self.mnt = mnt
        self.proc = subprocess.Popen([exe, mnt])
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the C floor did not mount")
            time.sleep(0.01)

    def threads(self) -> list[int]:
        """The daemon's threads (libfuse serves on one)."""
        return [int(t) for t in os.listdir(f"/proc/{self.proc.pid}/task")]

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False,
                       stderr=subprocess.DEVNULL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PyFloor:
    """``Floor`` mounted at ``mnt``, served by pyfuse3 + trio in a thread of this process
    until ``stop``."""

    def __init__(self, mnt: str) -> None:
        self.mnt = mnt
        self.tid = 0
        up = threading.Event()
        self.failed: BaseException | None = None

        async def serve() -> None:
            self.tid = threading.get_native_id()
            up.set()
            await pyfuse3.main()

        def run() -> None:
            try:
                trio.run(serve)
            except BaseException as e:   # shown by stop()
                self.failed = e
            finally:
                pyfuse3.close(unmount=False)
                up.set()

        pyfuse3.init(Floor(), mnt, {"fsname=floor", "default_permissions"})
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        up.wait()

    def threads(self) -> list[int]:
        return [self.tid]

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False,
                       stderr=subprocess.DEVNULL)
        self.thread.join(timeout=10)
        if self.failed is not None:
            raise RuntimeError(f"the pyfuse3 floor failed: {self.failed!r}")


def placements(names: list[str]) -> dict[str, tuple[set[int], set[int]]]:
    """Each placement's CPUs: (the program's, the daemon's). ``apart`` needs two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    out = {}
    for name in names:
        if name == "unpinned":
            out[name] = (set(cpus), set(cpus))
        elif name == "same":
            out[name] = ({cpus[0]}, {cpus[0]})
        elif name == "apart" and len(cpus) > 1:
            out[name] = ({cpus[0]}, {cpus[1]})
        elif name == "apart":
            print("fuse_floor: one CPU: the placement 'apart' is skipped", file=sys.stderr)
    return out


def pinned(cpus: set[int], fn, *args):
    """``fn(*args)`` run in a thread of its own placed on ``cpus`` (sched_setaffinity with
    pid 0 places the calling thread only)."""
    out: list = []

    def run() -> None:
        os.sched_setaffinity(0, cpus)
        try:
            out.append((True, fn(*args)))
        except BaseException as e:
            out.append((False, e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def place(threads: list[int], cpus: set[int]) -> None:
    for tid in threads:
        os.sched_setaffinity(tid, cpus)


LABELS = ("shm", "floor", "c floor")


def measure(n: int, rounds: int, names: list[str]) -> dict[str, dict[str, list]]:
    """Per placement: the rates of each label per round, [(create, stat, unlink), ...]."""
    where = placements(names)
    mnt = tempfile.mkdtemp(prefix="fuse-floor-")
    cmnt = tempfile.mkdtemp(prefix="fuse-floor-c-mnt-")
    shm = tempfile.mkdtemp(prefix="fuse-floor-", dir="/dev/shm")
    tmp = tempfile.mkdtemp(prefix="fuse-floor-c-")
    daemons: dict[str, PyFloor | CFloor] = {}
    out: dict[str, dict[str, list]] = {p: {label: [] for label in LABELS} for p in where}
    try:
        daemons["floor"] = PyFloor(mnt)
        daemons["c floor"] = CFloor(build_c(tmp), cmnt)
        paths = {"shm": shm, "floor": mnt, "c floor": cmnt}
        for r in range(rounds):
            for p, (program, daemon) in where.items():
                for label in LABELS:
                    if label != "shm":
                        place(daemons[label].threads(), daemon)
                    out[p][label].append(pinned(program, workload, paths[label], n))
            print(f"fuse_floor: round {r + 1} of {rounds} done", file=sys.stderr)
    finally:
        for d in daemons.values():
            d.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        for d in (mnt, cmnt):
            os.rmdir(d)
    return out


def report(n: int, got: dict[str, dict[str, list]]) -> str:
    phases = ("create+write+close", "stat", "unlink")
    lines = [f"{n} files of 4 KiB, files/s (median over rounds; ratio to /dev/shm in the same "
             f"round: median, range)"]
    for p, by in got.items():
        lines.append(f"placement {p}:")
        lines.append(f"  {'':14s}" + "".join(f"{ph:>34s}" for ph in phases))
        for label in LABELS:
            rates = by[label]
            cells = []
            for i in range(3):
                med = statistics.median(r[i] for r in rates)
                if label == "shm":
                    cells.append(f"{med:34.0f}")
                    continue
                ratios = [r[i] / s[i] for r, s in zip(rates, by["shm"])]
                cells.append(f"{med:10.0f} {statistics.median(ratios):7.3f}x "
                             f"({min(ratios):.3f}-{max(ratios):.3f})")
            lines.append(f"  {label:14s}" + "".join(f"{c:>34s}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(prog="tools/fuse_floor.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=2000, help="files per phase")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every placement")
    ap.add_argument("--placements", default="unpinned,same,apart",
                    help="comma-separated subset of unpinned,same,apart")
    a = ap.parse_args()
    names = [p for p in a.placements.split(",") if p]
    bad = [p for p in names if p not in ("unpinned", "same", "apart")]
    if bad or not names:
        print(f"fuse_floor: unknown placement {bad[0] if bad else a.placements!r}: "
              "use unpinned, same, apart", file=sys.stderr)
        return 2
    if a.n < 1 or a.rounds < 1:
        print("fuse_floor: N and --rounds must be at least 1", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("fuse_floor: run as root (it mounts a filesystem)", file=sys.stderr)
        return 2
    try:
        got = measure(a.n, a.rounds, names)
    except RuntimeError as e:
        print(f"fuse_floor: {e}", file=sys.stderr)
        return 1
    print(report(a.n, got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
