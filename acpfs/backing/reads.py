"""What the backing holds, read without changing it: listings, entries, directory versions,
files opened for reading, symlink targets and extended attributes.

What it owns (``TreeReads``, a piece of ``Backing``): no state of its own; the reading calls
on directories reached through ``RootDir.dir`` (``open_dir``). A listing hides acpfs's own entries
(``is_internal_name``) and removes the uploads that the dead daemon this one recovers left
half-written (``StagedFiles.is_leftover``), never another daemon's. ``versioned_listing`` and
``version`` are what tells another writer's change from this daemon's (docs/design.md,
"Conflicts with other writers of the backing").
"""

from __future__ import annotations

import errno
import logging
import os
import stat as statmod

from .names import Comps, MissingDir, check_name, is_internal_name

log = logging.getLogger("acpfs.backing")

ENTRY_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC   # an entry opened to be stat'ed


class TreeReads:
    """Reading calls on the backing tree (needs ``RootDir`` and ``StagedFiles`` beside it)."""

    def exists(self, comps: Comps, name: bytes) -> bool:
        """Is there an entry ``name`` in the directory at ``comps``?"""
        check_name(name)
        with self.dir(comps, absent=MissingDir) as dfd:
            if dfd is None:
                return False
            try:
                os.stat(name, dir_fd=dfd, follow_symlinks=False)
                return True
            except FileNotFoundError:
                return False

    @staticmethod
    def version(dfd: int, name: bytes) -> tuple[int, int, int]:
        """(inode, size, mtime) of a file: what tells another writer's version from ours."""
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def stat_entry(self, comps: Comps, name: bytes) -> os.stat_result | None:
        """lstat of an entry; None if it (or its directory) is gone.

        Where openat2 works, the entry itself is opened O_PATH (a symlink as itself) beneath
        the root in one call and fstat'ed: a lookup of a missing name, the commonest call of a
        burst of created files, costs one call and little Python. Any error but ENOENT goes the
        way that tells a missing or blocked directory and a stale root apart."""
        check_name(name)
        if self.beneath:
            for c in comps:
                check_name(c)
            try:
                fd = self._open_beneath([*comps, name], ENTRY_FLAGS)
            except FileNotFoundError:
                return None   # the name, or a directory above it
            except OSError:
                pass
            else:
                try:
                    return os.fstat(fd)
                finally:
                    os.close(fd)
        with self.dir(comps, absent=MissingDir) as dfd:
            if dfd is None:
                return None
            try:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return None

    def listdir(self, comps: Comps) -> list[tuple[bytes, os.stat_result, bytes | None]]:
        """(name, lstat result, symlink target) of each entry, without acpfs temporary files.

        Uploads the dead daemon this one recovered from left half-written are removed; those
        of any other daemon (other nodes' included) are left alone.
        """
        with self.dir(comps) as fd:
            return self._entries(fd)

    def versioned_listing(self, comps: Comps, unless: tuple[int, int, int] | None = None
                          ) -> tuple[tuple[int, int, int], list] | None:
        """A directory's version, (inode, mtime, ctime): any entry made or removed in it
        changes it (to the resolution of the backing's clock), taken before ``listdir`` of it,
        from one open of it; None (nothing listed) when the version is ``unless``.
        MissingDir where it is gone."""
        with self.dir(comps) as fd:
            st = os.fstat(fd)
            version = st.st_ino, st.st_mtime_ns, st.st_ctime_ns
            if version == unless:
                return None
            return version, self._entries(fd)

    def _entries(self, fd: int) -> list[tuple[bytes, os.stat_result, bytes | None]]:
        """``listdir`` of the directory open at ``fd``."""
        out = []
        with os.scandir(fd) as it:
            for ent in it:
                name = os.fsencode(ent.name)
                if is_internal_name(name):
                    if self.is_leftover(name):
                        try:
                            if ent.is_dir(follow_symlinks=False):
                                os.rmdir(name, dir_fd=fd)    # a mkdir cut short
                            else:
                                os.unlink(name, dir_fd=fd)
                            log.info("removed %r, left unfinished by the dead daemon",
                                     os.fsdecode(name))
                        except OSError:
                            pass
                    continue
                try:
                    st = ent.stat(follow_symlinks=False)
                    target = os.readlink(name, dir_fd=fd) if statmod.S_ISLNK(st.st_mode) else None
                except FileNotFoundError:
                    continue
                out.append((name, st, target))
        return out

    def open_file(self, comps: Comps, name: bytes) -> int:
        """Open a regular file of the backing for reading (never through a symlink; a FIFO
        another writer put under the name does not block the open)."""
        return self.open_in(comps, name, os.O_RDONLY | os.O_NONBLOCK)

    def open_version(self, comps: Comps, name: bytes,
                     version: tuple[int, int, int] | None) -> tuple[int, os.stat_result]:
        """Open a regular file of the backing for reading, with the fstat of what was opened.
        With ``version`` ((inode, size, mtime) of the copy the caller knows), another version
        found under the name is ``ESTALE``: nothing is ever read from a file that replaced
        the one whose size the mount reports (docs/semantics.md, section 10)."""
        fd = self.open_file(comps, name)
        try:
            st = os.fstat(fd)
            if not statmod.S_ISREG(st.st_mode):
                raise OSError(errno.ESTALE, "another writer put another kind of file under the name")
            os.set_blocking(fd, True)   # a regular file: reads as any other descriptor of it
            if version is not None and (st.st_ino, st.st_size, st.st_mtime_ns) != version:
                raise OSError(errno.ESTALE, "another writer replaced the file in the backing")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def find_names(self, ino: int, want: int, skip: set[tuple[tuple[bytes, ...], bytes]]
                   ) -> list[tuple[Comps, bytes]]:
        """Up to ``want`` names of the file with inode ``ino`` in the backing tree, other than
        those in ``skip`` ((directory components, name) pairs): a walk that follows no
        symlink and skips acpfs's own entries. Costs a stat per entry: only for a file with
        more names in the backing than the mount knows (Publisher.unknown_names)."""
        out: list[tuple[Comps, bytes]] = []
        stack: list[Comps] = [[]]
        while stack and len(out) < want:
            comps = stack.pop()
            with self.dir(comps, absent=(MissingDir, PermissionError)) as fd:
                if fd is None:
                    continue
                with os.scandir(fd) as it:
                    for ent in it:
                        name = os.fsencode(ent.name)
                        if is_internal_name(name):
                            continue
                        try:
                            st = ent.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if statmod.S_ISDIR(st.st_mode):
                            stack.append(comps + [name])
                        elif st.st_ino == ino and statmod.S_ISREG(st.st_mode) \
                                and (tuple(comps), name) not in skip:
                            out.append((comps, name))
        return out[:want]

    def read_xattrs(self, comps: Comps, name: bytes | None) -> dict[bytes, bytes]:
        """User extended attributes of a file or directory (``name`` None: the directory itself)."""
        with self.dir(comps, absent=OSError) as dfd:
            if dfd is None:
                return {}
            try:
                fd = dfd if name is None else os.open(
                    name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    return {os.fsencode(k): os.getxattr(fd, k) for k in os.listxattr(fd)
                            if k.startswith("user.")}
                finally:
                    if fd != dfd:
                        os.close(fd)
            except OSError:
                return {}

    def read_link(self, comps: Comps, name: bytes) -> bytes | None:
        """The target of a symlink; None if it is gone or not a symlink."""
        check_name(name)
        with self.dir(comps) as dfd:
            try:
                return os.readlink(name, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINVAL):
                    return None
                raise
