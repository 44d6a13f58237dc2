"""tools/passthrough_floor_py.py MOUNTPOINT BACKING: the Python twin of passthrough_floor.c.

What a daemon in Python could reach for a load of a file the cache does not hold, on the
same transport as acpfs (pyfuse3 under trio, with acpfs's C extension: the burst loop, the
requests offered to Python without a coroutine, GETATTR answered from the attribute table,
kernel passthrough) and with nothing else: a LOOKUP is one ``lstat`` of the name in
BACKING, a read-only OPEN opens the backing file once per inode and passes every open of
the inode through to it, RELEASE closes it after the last, FLUSH does nothing. Nothing is
cached, kept, checked against another node or persisted; writers and everything else get
EROFS or ENOSYS. ``tools/passthrough_floor.py`` mounts it beside the C floor and acpfs.

Threads: the trio thread only (the hooks run inside pyfuse3's request loop).
"""

from __future__ import annotations

import errno
import os
import sys

from acpfs.fuse import attrtable, fastwrite   # before pyfuse3: the extension hooks its session

import pyfuse3   # noqa: E402
import trio      # noqa: E402

TIMEOUT = 1.0    # the kernel keeps entries and attributes this long, as acpfs's default
BLKSIZE = 4096


class PyFloor(pyfuse3.Operations):
    def __init__(self, backing: str) -> None:
        super().__init__()
        self.backing = os.fsencode(backing)
        self.paths: dict[int, bytes] = {pyfuse3.ROOT_INODE: b""}   # inode -> path in BACKING
        self.inodes: dict[bytes, int] = {b"": pyfuse3.ROOT_INODE}
        self.opens: dict[int, list[int]] = {}      # inode -> [fd, backing id, opens]
        self.handles: dict[int, int] = {}          # file handle -> inode
        self.next_fh = 1

    # -- answered at once (the extension's hooks) -------------------------------------------
    def lookup_now(self, parent: int, name: bytes) -> tuple | int:
        rel = self.paths[parent] + b"/" + name if parent != pyfuse3.ROOT_INODE else name
        try:
            st = os.lstat(self.backing + b"/" + rel)
        except OSError as e:
            return -e.errno
        ino = self.inodes.get(rel)
        if ino is None:
            ino = self.inodes[rel] = len(self.paths) + pyfuse3.ROOT_INODE
            self.paths[ino] = rel
        attrtable.put(ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_rdev,
                      st.st_size, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, TIMEOUT)
        return (ino, TIMEOUT, TIMEOUT, st.st_mode, st.st_nlink, st.st_uid, st.st_gid,
                st.st_rdev, st.st_size, BLKSIZE, st.st_blocks, st.st_atime_ns,
                st.st_mtime_ns, st.st_ctime_ns)

    def open_now(self, ino: int, flags: int) -> tuple[int, int] | int:
        held = self.opens.get(ino)
        if held is None:
            try:
                fd = os.open(self.backing + b"/" + self.paths[ino], os.O_RDONLY)
            except OSError as e:
                return -e.errno
            held = self.opens[ino] = [fd, fastwrite.extension().backing_open(fd), 0]
        held[2] += 1
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = ino
        return fh, held[1]

    def release_now(self, fh: int) -> int:
        ino = self.handles.pop(fh)
        held = self.opens[ino]
        held[2] -= 1
        if held[2] == 0:
            del self.opens[ino]
            fastwrite.extension().backing_close(held[1])
            os.close(held[0])
        return 0

    @staticmethod
    def flush_now(fh: int) -> int:
        return 0

    def hooks(self) -> dict:
        return {"lookup": self.lookup_now, "open": self.open_now, "release": self.release_now,
                "flush": self.flush_now}

    # -- pyfuse3's path: what the hooks do not take ------------------------------------------
    async def getattr(self, inode, ctx=None):
        try:
            st = os.lstat(self.backing + b"/" + self.paths[inode])
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno)
        a = pyfuse3.EntryAttributes()
        for field in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                      "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(a, field, getattr(st, field))
        a.st_ino, a.st_blksize = inode, BLKSIZE
        a.entry_timeout = a.attr_timeout = TIMEOUT
        return a

    async def open(self, inode, flags, ctx):
        raise pyfuse3.FUSEError(errno.EROFS)   # a writer: the hook took every reader

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def forget(self, inode_list):
        pass


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: passthrough_floor_py.py MOUNTPOINT BACKING")
    mountpoint, backing = sys.argv[1:]
    ops = PyFloor(backing)
    fastwrite.ask_passthrough(1)
    pyfuse3.init(ops, mountpoint, set(pyfuse3.default_options) | {"fsname=pyfloor"})
    if not fastwrite.install(lambda fh, off, buf: None, at_once=ops.hooks()):
        sys.exit("passthrough_floor_py: acpfs's C extension does not hook the session")
    attrtable.enable(BLKSIZE)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
