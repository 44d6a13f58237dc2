"""faultfs: a small passthrough FUSE filesystem that can be told to fail or to hang.

    python tests/faultfs.py SOURCE MOUNTPOINT CONTROL

mirrors the directory SOURCE at MOUNTPOINT. Before each request it reads the file CONTROL
(re-read when its mtime or size changes):

    ok                  serve every request (also when CONTROL is missing or empty)
    eio [OP ...]        fail requests with EIO (only the named handlers, e.g. ``eio write create``)
    hang [OP ...]       do not answer requests until CONTROL says otherwise
    slow S [OP ...]     answer requests S seconds late (a slow store: ``slow 0.005 write``)

It counts the requests it gets, by handler, and the bytes its READs returned ("read_bytes"),
in CONTROL.counts (JSON, rewritten every 0.1 s while they change): what the filesystem below
saw, as a network filesystem's server would.

Stopping the process (SIGSTOP) is the other way to hang it. Inode numbers are mapped to the
(device, inode) of the source files, each with its current path: the source's own number
where it is free (two views of one directory show a file under one number, as the clients
of one NFS export do), else one from ``OWN_INOS`` up; renames move
the paths of everything under the renamed name. Every attribute timeout is 0, so the kernel
asks again each time and sees faults at once.

The module also holds ``FaultFS``, the test-side handle: start, control, stop, unmount.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import stat
import signal
import subprocess
import sys
import time
from pathlib import Path

OWN_INOS = 1 << 48   # inode numbers given where the source's own is taken (or the root's)

try:
    import pyfuse3
    import trio
except ImportError:  # the test side only needs FaultFS
    pyfuse3 = None


# -- the filesystem (runs in its own process) ------------------------------------------------

if pyfuse3 is not None:
    def handler(fn):
        name = fn.__name__

        @functools.wraps(fn)
        async def wrapper(self, *args):
            await self.gate(name)
            try:
                return fn(self, *args)
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        return wrapper

    class FaultFS(pyfuse3.Operations):
        enable_writeback_cache = False

        def __init__(self, source: bytes, control: str) -> None:
            super().__init__()
            self.control = control
            self.ctl_key = None
            self.counts: dict[str, int] = {}   # requests served, by handler (CONTROL.counts)
            self.counts_changed = False
            self.mode: tuple[str, frozenset] = ("ok", frozenset())
            st = os.lstat(source)
            self.inos = {(st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)): pyfuse3.ROOT_INODE}
            self.paths = {pyfuse3.ROOT_INODE: source}
            self.keys: dict[int, tuple] = {}   # inode -> (dev, ino, type) it stands for
            self.next_ino = OWN_INOS
            self.dirs: dict[int, tuple[int, list]] = {}
            self.next_dh = 1

        # fault control
        def read_mode(self) -> tuple[str, frozenset]:
            try:
                st = os.stat(self.control)
            except FileNotFoundError:
                return ("ok", frozenset())
            key = (st.st_mtime_ns, st.st_size, st.st_ino)
            if key != self.ctl_key:
                with open(self.control) as f:
                    words = f.read().split()
                self.ctl_key = key
                self.mode = (words[0], frozenset(words[1:])) if words else ("ok", frozenset())
            return self.mode

        async def gate(self, name: str) -> None:
            self.counts[name] = self.counts.get(name, 0) + 1
            self.counts_changed = True
            while True:
                mode, ops = self.read_mode()
                if mode == "slow":
                    delay, *ops = sorted(ops, key=lambda w: not w[:1].isdigit())
                    if not ops or name in ops:
                        await trio.sleep(float(delay))
                    return
                if mode == "ok" or (ops and name not in ops):
                    return
                if mode == "eio":
                    raise pyfuse3.FUSEError(errno.EIO)
                await trio.sleep(0.02)   # "hang": hold the request

        async def write_counts(self) -> None:
            """Runs beside the session: CONTROL.counts every 0.1 s while the counts change."""
            while True:
                if self.counts_changed:
                    self.counts_changed = False
                    tmp = self.control + ".counts.new"
                    with open(tmp, "w") as f:
                        f.write(json.dumps(self.counts))
                    os.replace(tmp, self.control + ".counts")
                await trio.sleep(0.1)

        # inodes and paths
        def path(self, ino: int) -> bytes:
            """Where inode ``ino`` is now. Another process (another node's faultfs view of
            the same directory) may have moved it or put something else at its path: then
            it is looked for in the whole tree, as an NFS file handle would still find it,
            and ESTALE if it is gone (never another entry's attributes under its number)."""
            try:
                p = self.paths[ino]
            except KeyError:
                raise OSError(errno.ESTALE, "unknown inode") from None
            key = self.keys.get(ino)
            if key is None:
                return p
            try:
                st = os.lstat(p)
                if (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)) == key:
                    return p
            except OSError:
                pass
            for top, dirs, files in os.walk(self.paths[pyfuse3.ROOT_INODE]):
                for name in dirs + files:
                    q = os.path.join(top, name)
                    try:
                        st = os.lstat(q)
                    except OSError:
                        continue
                    if (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)) == key:
                        self.moved(p, q)
                        return q
            raise OSError(errno.ESTALE, "moved or removed by another process")

        def child(self, parent: int, name: bytes) -> bytes:
            return os.path.join(self.path(parent), name)

        def entry(self, path: bytes, st: os.stat_result | None = None) -> pyfuse3.EntryAttributes:
            st = st or os.lstat(path)
            # the file type is part of the key: an inode number freed and reused for another
            # kind of entry (a file removed, a directory made) must not reach the kernel as
            # the inode it knows, which it would mark bad (EIO for good)
            key = (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode))
            ino = self.inos.get(key)
            if ino is None:
                # the source's own number where it is free here, so that two views of one
                # directory (two nodes' backings) show a file under one inode number, as NFS
                # clients do; another from a range of its own where it is taken
                ino = st.st_ino
                if ino in self.keys or ino <= pyfuse3.ROOT_INODE or ino >= OWN_INOS:
                    ino = self.next_ino
                    self.next_ino += 1
                self.inos[key] = ino
                self.keys[ino] = key
            self.paths[ino] = path
            e = pyfuse3.EntryAttributes()
            for a in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                      "st_atime_ns", "st_mtime_ns", "st_ctime_ns", "st_blksize", "st_blocks"):
                setattr(e, a, getattr(st, a))
            e.st_ino = ino
            e.generation = 0
            e.entry_timeout = 0
            e.attr_timeout = 0
            return e

        def moved(self, old: bytes, new: bytes) -> None:
            for ino, p in list(self.paths.items()):
                if p == old or p.startswith(old + b"/"):
                    self.paths[ino] = new + p[len(old):]

        # namespace
        @handler
        def lookup(self, parent_inode, name, ctx=None):
            return self.entry(self.child(parent_inode, name))

        async def forget(self, inode_list):
            pass   # paths are kept; a later lookup refreshes them

        @handler
        def getattr(self, inode, ctx=None):
            return self.entry(self.path(inode))

        @handler
        def setattr(self, inode, attr, fields, fh, ctx):
            path = self.path(inode)
            target = fh if fh is not None else path
            if fields.update_size:
                os.truncate(target, attr.st_size)
            if fields.update_mode:
                os.chmod(target, attr.st_mode & 0o7777)
            if fields.update_uid or fields.update_gid:
                os.chown(target, attr.st_uid if fields.update_uid else -1,
                         attr.st_gid if fields.update_gid else -1,
                         **({} if fh is not None else {"follow_symlinks": False}))
            if fields.update_atime or fields.update_mtime:
                st = os.lstat(path)
                times = (attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                         attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns)
                if fh is not None:
                    os.utime(fh, ns=times)
                else:
                    os.utime(path, ns=times, follow_symlinks=False)
            return self.entry(path)

        @handler
        def readlink(self, inode, ctx):
            return os.readlink(self.path(inode))

        @handler
        def mkdir(self, parent_inode, name, mode, ctx):
            path = self.child(parent_inode, name)
            os.mkdir(path, mode & 0o7777)
            return self.entry(path)

        @handler
        def symlink(self, parent_inode, name, target, ctx):
            path = self.child(parent_inode, name)
            os.symlink(target, path)
            return self.entry(path)

        @handler
        def unlink(self, parent_inode, name, ctx):
            os.unlink(self.child(parent_inode, name))

        @handler
        def rmdir(self, parent_inode, name, ctx):
            os.rmdir(self.child(parent_inode, name))

        @handler
        def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
            if flags:
                raise OSError(errno.EINVAL, "rename flags are not supported")
            old, new = self.child(parent_inode_old, name_old), self.child(parent_inode_new, name_new)
            os.rename(old, new)
            self.moved(old, new)

        @handler
        def link(self, inode, new_parent_inode, new_name, ctx):
            raise OSError(errno.EPERM, "no hard links")

        @handler
        def mknod(self, parent_inode, name, mode, rdev, ctx):
            raise OSError(errno.EPERM, "no special files")

        @handler
        def access(self, inode, mode, ctx):
            return True

        @handler
        def statfs(self, ctx):
            st = os.statvfs(self.paths[pyfuse3.ROOT_INODE])
            out = pyfuse3.StatvfsData()
            for a in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                      "f_ffree", "f_favail", "f_namemax"):
                setattr(out, a, getattr(st, a))
            return out

        # directories
        @handler
        def opendir(self, inode, ctx):
            path = self.path(inode)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            entries = []
            for name in sorted(os.listdir(path)):
                try:
                    entries.append((name, self.entry(os.path.join(path, name))))
                except FileNotFoundError:
                    pass
            dh = self.next_dh
            self.next_dh += 1
            self.dirs[dh] = (fd, entries)
            return dh

        @handler
        def readdir(self, fh, start_id, token):
            entries = self.dirs[fh][1]
            for i in range(start_id, len(entries)):
                if not pyfuse3.readdir_reply(token, entries[i][0], entries[i][1], i + 1):
                    break

        async def releasedir(self, fh):
            fd, _ = self.dirs.pop(fh, (-1, None))
            if fd >= 0:
                os.close(fd)

        @handler
        def fsyncdir(self, fh, datasync):
            os.fsync(self.dirs[fh][0])

        # files (the handle is the source file's descriptor)
        @handler
        def open(self, inode, flags, ctx):
            fd = os.open(self.path(inode), flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY))
            return pyfuse3.FileInfo(fh=fd)

        @handler
        def create(self, parent_inode, name, mode, flags, ctx):
            path = self.child(parent_inode, name)
            fd = os.open(path, flags | os.O_CREAT, mode & 0o7777)
            return pyfuse3.FileInfo(fh=fd), self.entry(path, os.fstat(fd))

        @handler
        def read(self, fh, off, size):
            data = os.pread(fh, size, off)
            self.counts["read_bytes"] = self.counts.get("read_bytes", 0) + len(data)
            return data

        @handler
        def write(self, fh, off, buf):
            return os.pwrite(fh, buf, off)

        @handler
        def flush(self, fh):
            pass

        async def release(self, fh):
            os.close(fh)

        @handler
        def fsync(self, fh, datasync):
            os.fsync(fh)

        # extended attributes
        @handler
        def getxattr(self, inode, name, ctx):
            return os.getxattr(self.path(inode), name, follow_symlinks=False)

        @handler
        def setxattr(self, inode, name, value, ctx):
            os.setxattr(self.path(inode), name, value, follow_symlinks=False)

        @handler
        def listxattr(self, inode, ctx):
            return [os.fsencode(n) for n in os.listxattr(self.path(inode), follow_symlinks=False)]

        @handler
        def removexattr(self, inode, name, ctx):
            os.removexattr(self.path(inode), name, follow_symlinks=False)

    def main() -> None:
        import logging
        logging.basicConfig(level=logging.WARNING)   # pyfuse3 logs a handler's crash here
        source, mountpoint, control = sys.argv[1:4]
        fs = FaultFS(os.fsencode(os.path.abspath(source)), control)
        opts = set(pyfuse3.default_options)
        opts.add("fsname=faultfs")
        pyfuse3.init(fs, mountpoint, opts)
        async def serve() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fs.write_counts)
                await pyfuse3.main()
                nursery.cancel_scope.cancel()

        try:
            trio.run(serve)
        finally:
            pyfuse3.close(unmount=False)


# -- the test side ------------------------------------------------------------------------------

def _mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


class Shim:
    """A faultfs process mirroring ``source`` at ``mountpoint``; always ``close()`` it."""

    def __init__(self, source: Path, mountpoint: Path, control: Path) -> None:
        self.source, self.mnt, self.control = source, mountpoint, control
        self.control.write_text("ok\n")
        self.stopped = False
        self.proc = subprocess.Popen([sys.executable, __file__, str(source), str(mountpoint),
                                      str(control)])
        deadline = time.monotonic() + 20
        while not _mounted(mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"faultfs did not mount {mountpoint} (exit {self.proc.poll()})")
            time.sleep(0.05)

    def set(self, mode: str) -> None:
        """``ok``, ``eio [OP ...]``, ``hang [OP ...]`` or ``slow S [OP ...]`` (see the module
        docstring)."""
        tmp = self.control.with_suffix(".new")
        tmp.write_text(mode + "\n")
        os.replace(tmp, self.control)

    def counts(self) -> dict[str, int]:
        """Requests served so far, by handler, and "read_bytes" (up to 0.1 s old)."""
        try:
            return json.loads(Path(str(self.control) + ".counts").read_text())
        except FileNotFoundError:
            return {}

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.set("ok")
        finally:
            if _mounted(self.mnt):
                r = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
                if r.returncode != 0:
                    subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
            try:   # a mount namespace made while it was mounted holds a copy: it never exits
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            if _mounted(self.mnt):
                subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)


if __name__ == "__main__":
    main()
