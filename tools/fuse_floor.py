"""tools/fuse_floor.py: the fastest a FUSE daemon can answer small-file requests here.

Mounts two filesystems that keep nothing but names and sizes and answer every request at
once (no cache, no journal, no backing): one in pyfuse3 + trio (``Floor`` below) and its
twin in C on libfuse's low-level API (tools/fuse_floor.c, built here with cc). On each and
on a /dev/shm directory it creates, writes 4 KiB into and closes N files, stats them and
removes them, as ``tools/bench --workloads small`` does, and prints the rates side by side.
The Python floor is the ceiling of acpfs's small-file figures while requests are answered
in Python; the C floor is the ceiling of any FUSE daemon on this kernel and machine, since
it pays only the kernel's round trips (docs/benchmarks.md).

    .venv/bin/python tools/fuse_floor.py [N]     # as root; N files (default 2000)
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
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


def c_floor(n: int, tmp: str) -> tuple[float, float, float]:
    """Build tools/fuse_floor.c, mount it under ``tmp``, run the workload on it."""
    exe = os.path.join(tmp, "fuse-floor-c")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuse_floor.c")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                           capture_output=True, text=True).stdout.split()
    subprocess.run(["cc", "-O2", "-o", exe, src, *flags], check=True)
    mnt = os.path.join(tmp, "mnt")
    os.mkdir(mnt)
    proc = subprocess.Popen([exe, mnt])
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("fuse_floor: the C floor did not mount")
            time.sleep(0.01)
        return workload(mnt, n)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
        proc.wait(timeout=10)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    if os.geteuid() != 0:
        print("fuse_floor: run as root (it mounts a filesystem)", file=sys.stderr)
        return 2
    mnt = tempfile.mkdtemp(prefix="fuse-floor-")
    shm = tempfile.mkdtemp(prefix="fuse-floor-", dir="/dev/shm")
    ops = Floor()
    pyfuse3.init(ops, mnt, {"fsname=floor", "default_permissions"})
    done = threading.Event()
    out: dict[str, tuple[float, float, float]] = {}

    def run() -> None:
        try:
            out["shm"] = workload(shm, n)
            out["floor"] = workload(mnt, n)
        finally:
            done.set()
            subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)

    async def serve() -> None:
        threading.Thread(target=run, daemon=True).start()
        await pyfuse3.main()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=False)
        shutil.rmtree(shm, ignore_errors=True)
        os.rmdir(mnt)
    done.wait()
    tmp = tempfile.mkdtemp(prefix="fuse-floor-c-")
    try:
        out["c floor"] = c_floor(n, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{n} files of 4 KiB, files/s    create+write+close       stat     unlink")
    for label in ("shm", "floor", "c floor"):
        c, s, u = out[label]
        print(f"  {label:29s} {c:10.0f} {s:10.0f} {u:10.0f}")
    c0, s0, u0 = out["shm"]
    for label in ("floor", "c floor"):
        c1, s1, u1 = out[label]
        print(f"  {label + '/shm':29s} {c1 / c0:9.3f}x {s1 / s0:9.3f}x {u1 / u0:9.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
