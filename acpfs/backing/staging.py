"""Temporary and staged files in the backing, and how content reaches a final name.

What it owns (``StagedFiles``, a piece of ``Backing``): this daemon's identity in temporary
names (``instance``, ``mine``) and its dead predecessor's (``dead``), whose leftovers are
this daemon's to clean up; this daemon's staging directory (``staging_dir``, which exists
only while it holds files; ``_staging_lock`` keeps its creation and removal from crossing);
the calls on temporary files, from their exclusive, private creation to ``publish``; and the
calls on descriptors opened in the backing (reads, writes, truncates, fsyncs, closes).

Atomicity invariant (contract 3): file content reaches a final name only through
``write_temp`` (temporary name in the same directory, data, owner, mode, times, fsync)
followed by ``publish`` (rename over the final name, fsync of the directory).
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from typing import Iterable

from .names import STALE, TEMP_PREFIX, check_name, new_instance, staged_ino, staging_dir_of
from ..store.api import copy_fd


class StagedFiles:
    """Temporary and staged files of one daemon ``instance`` (needs ``RootDir`` and
    ``TreeChanges`` beside it); ``dead_instance`` is the daemon whose journal this one
    recovers."""

    def __init__(self, instance: str | None = None, dead_instance: str | None = None) -> None:
        self._staging_lock = threading.Lock()
        self.instance = instance or new_instance()
        self.mine = TEMP_PREFIX + self.instance.encode() + b"-"
        self.dead = TEMP_PREFIX + dead_instance.encode() + b"-" if dead_instance else None
        self.staging_dir = self.mine + b"staging"

    def temp_name(self) -> bytes:
        """A fresh name for an upload's temporary file."""
        return self.mine + secrets.token_hex(8).encode()

    def staged_name(self, ino: int) -> bytes:
        """A fresh name for the staged file of inode ``ino``."""
        return self.mine + secrets.token_hex(8).encode() + b"-i%d" % ino

    def is_leftover(self, name: bytes) -> bool:
        """A temporary file of the dead daemon this one recovered from."""
        return self.dead is not None and name.startswith(self.dead)

    def owns(self, name: bytes) -> bool:
        """A temporary file this daemon may remove: its own or its dead predecessor's."""
        return name.startswith(self.mine) or self.is_leftover(name)

    def create_temp(self, dfd: int, tmpname: bytes) -> int:
        """Create a temporary file: exclusively (never someone else's file under a name it
        guessed), private (0600 until ``finish_temp`` gives it its mode)."""
        return os.open(tmpname, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600, dir_fd=dfd)

    def write_temp(self, dfd: int, tmpname: bytes, extents: Iterable[tuple[int, int, int]],
                   src_fd: int, size: int, mode: int, uid: int, gid: int, times: tuple[int, int],
                   xattrs: dict[bytes, bytes], should_stop=lambda: False) -> bool:
        """Write a complete file under ``tmpname`` in directory ``dfd`` and fsync it.

        ``extents`` are (file offset, source offset, length) runs copied with sendfile from
        ``src_fd`` (the cache pool); gaps stay holes. Returns False if ``should_stop()``
        became true midway (the temporary file is then removed).
        """
        fd = self.create_temp(dfd, tmpname)
        ok = False
        try:
            if not self.copy_extents(fd, extents, src_fd, should_stop):
                return False
            self.finish_temp(fd, size, mode, uid, gid, times, xattrs)
            ok = True
            return True
        finally:
            os.close(fd)
            if not ok:
                self.remove_temp(dfd, tmpname)

    def copy_extents(self, fd: int, extents: Iterable[tuple[int, int, int]], src_fd: int,
                     should_stop=lambda: False) -> bool:
        for foff, soff, length in extents:
            if should_stop():
                return False
            done = 0
            while done < length:
                os.lseek(fd, foff + done, os.SEEK_SET)
                n = os.sendfile(fd, src_fd, soff + done, length - done)
                if n == 0:
                    raise OSError(errno.EIO, "short sendfile from the cache pool")
                done += n
        return True

    def copy_file(self, src_fd: int, dst_fd: int, size: int) -> None:
        """Copy a backing file into a temporary one (server-side where the filesystem can)."""
        copy_fd(src_fd, dst_fd, size)

    def finish_temp(self, fd: int, size: int, mode: int, uid: int, gid: int, times: tuple[int, int],
                    xattrs: dict[bytes, bytes]) -> None:
        """Give a temporary file its final size, owner, mode, xattrs and times; fsync it."""
        os.ftruncate(fd, size)
        self._set_owner_mode(fd, mode, uid, gid)
        if xattrs:
            self._apply_xattrs(fd, list(xattrs.items()))
        os.utime(fd, ns=times)
        os.fsync(fd)

    def remove_temp(self, dfd: int, tmpname: bytes) -> None:
        try:
            os.unlink(tmpname, dir_fd=dfd)
        except FileNotFoundError:
            pass

    def publish(self, src_dfd: int, tmpname: bytes, dst_dfd: int, name: bytes,
                defer: bool = False) -> bool:
        """Atomically move a complete temporary file over its final name, durably: the
        directory fsynced, or, with ``defer`` and a temporary file in that same directory,
        left to the caller (True: ``dst_dfd`` is to be fsynced; flusher/groups.py)."""
        check_name(name)
        os.rename(tmpname, name, src_dir_fd=src_dfd, dst_dir_fd=dst_dfd)
        same = dst_dfd == src_dfd or os.path.samestat(os.fstat(src_dfd), os.fstat(dst_dfd))
        if defer and same:
            return True
        os.fsync(dst_dfd)
        if not same:
            os.fsync(src_dfd)
        return False

    def temp_exists(self, dfd: int, tmpname: bytes) -> bool:
        """Is the temporary file still there? (False also when its directory is gone.)"""
        try:
            os.stat(tmpname, dir_fd=dfd, follow_symlinks=False)
            return True
        except OSError as e:
            if e.errno in STALE or e.errno in (errno.ENOENT, errno.EBADF):
                return False
            raise

    def restage(self, src_fd: int, tmpname: bytes, size: int) -> tuple[int, int]:
        """Copy ``size`` bytes of ``src_fd`` into a staged file named ``tmpname`` (its own
        staging directory): complete and fsynced under a fresh name first, then renamed over
        ``tmpname``. Returns (directory fd, file fd)."""
        copy = self.temp_name()
        dfd, fd = self.create_staged(copy, staging_dir_of(tmpname))
        try:
            self.copy_file(src_fd, fd, size)
            os.fsync(fd)
            os.rename(copy, tmpname, src_dir_fd=dfd, dst_dir_fd=dfd)
            return dfd, fd
        except BaseException:
            try:
                self.remove_temp(dfd, copy)
            finally:
                os.close(fd)
                os.close(dfd)
            raise

    def create_staged(self, tmpname: bytes, where: bytes | None = None) -> tuple[int, int]:
        """Create the staged file of a written-through file: (directory fd, file fd), in the
        staging directory its name gives (or ``where``).

        The staging directory exists only while it holds files (``remove_staging_dir``), so
        that an idle backing equals the mount's view; ``_staging_lock`` keeps creation and
        removal from crossing.
        """
        where = where or staging_dir_of(tmpname)
        with self._staging_lock:
            try:
                os.mkdir(where, 0o700, dir_fd=self.root_fd)
            except FileExistsError:
                pass
            dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=self.root_fd)
            try:
                return dfd, self.create_temp(dfd, tmpname)
            except BaseException:
                os.close(dfd)
                raise

    def remove_staging_dir(self, tmpname: bytes | None = None) -> None:
        """Remove this daemon's staging directory (or the one of ``tmpname``) if it is empty."""
        self._remove_dir(self.staging_dir if tmpname is None else staging_dir_of(tmpname))

    def _remove_dir(self, name: bytes) -> None:
        with self._staging_lock:
            try:
                os.rmdir(name, dir_fd=self.root_fd)
            except OSError:
                pass

    def open_staged(self, tmpname: bytes, write: bool = True) -> tuple[int, int] | None:
        """Open a staged file a dead daemon left: (directory fd, file fd), None if gone;
        for reading only unless ``write``."""
        check_name(tmpname)
        try:
            dfd = os.open(staging_dir_of(tmpname), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=self.root_fd)
        except FileNotFoundError:
            return None
        try:
            return dfd, os.open(tmpname, (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW
                                | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            os.close(dfd)
            return None
        except BaseException:
            os.close(dfd)
            raise

    def list_leftover_staged(self) -> list[bytes]:
        """Staged files the dead daemon left in its staging directory (none if its journal
        named no instance)."""
        if self.dead is None:
            return []
        try:
            dfd = os.open(self.dead + b"staging",
                          os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.root_fd)
        except FileNotFoundError:
            return []
        try:
            return [n for n in map(os.fsencode, os.listdir(dfd)) if staged_ino(n) is not None]
        finally:
            os.close(dfd)

    def remove_leftover_staging_dir(self) -> None:
        """Remove the dead daemon's staging directory if it is empty."""
        if self.dead is not None:
            self._remove_dir(self.dead + b"staging")

    def remove_staged(self, tmpname: bytes) -> None:
        check_name(tmpname)
        try:
            os.unlink(staging_dir_of(tmpname) + b"/" + tmpname, dir_fd=self.root_fd)
        except FileNotFoundError:
            pass

    def read(self, fd: int, size: int, off: int) -> bytes:
        return os.pread(fd, size, off)

    def read_into(self, fd: int, buf: memoryview, off: int) -> int:
        return os.preadv(fd, [buf], off)

    def read_cached(self, fd: int, buf: memoryview, off: int) -> int | None:
        """Bytes read into ``buf`` from what the page cache holds at ``off`` (the read never
        waits for the disk or the network: RWF_NOWAIT), or None where none of them is there
        or the filesystem cannot read so."""
        try:
            return os.preadv(fd, [buf], off, os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return None
            raise

    def write(self, fd: int, data: bytes | memoryview, off: int) -> int:
        return os.pwrite(fd, data, off)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close_fd(self, fd: int) -> None:
        os.close(fd)

    def stat_fd(self, fd: int) -> os.stat_result:
        return os.fstat(fd)
