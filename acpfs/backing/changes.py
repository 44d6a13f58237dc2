"""Changes to the backing's namespace and metadata: directories, symlinks, special files,
unlinks, renames, hard links, owners, modes, times and extended attributes, and moving
another writer's entry aside.

What it owns (``TreeChanges``, a piece of ``Backing``): the namespace operations, each
followed by an fsync of the directories it changed, and each landing in one step (made
under a temporary name with its owner and mode, then renamed into place); the owner, mode
and xattr helpers that staged files use too; and whether the WARNING that the backing has
no user xattrs was given (``_xattr_warned``). An rmdir removes this daemon's (or its dead
predecessor's) temporary files with the directory, never anyone else's (``NotEmpty``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat as statmod

from .names import CONFLICTS_DIR, IS_ROOT, Comps, MissingDir, NotEmpty, check_name

log = logging.getLogger("acpfs.backing")


class TreeChanges:
    """Changing calls on the backing tree (needs ``RootDir`` and ``StagedFiles`` beside it)."""

    def __init__(self) -> None:
        self._xattr_warned = False

    def mkdir(self, comps: Comps, name: bytes, mode: int, uid: int, gid: int) -> bool:
        """Make a directory with its owner and mode at once: made private under a temporary
        name, given its owner and mode, renamed into place (nobody sees it with another
        mode or owner). An existing directory of that name gets the owner and mode.
        Returns whether this call made it (False: it was there, or another writer made it
        meanwhile)."""
        check_name(name)
        with self.dir(comps) as dfd:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not statmod.S_ISDIR(st.st_mode):
                raise OSError(errno.EEXIST, f"{os.fsdecode(name)!r} exists and is not a directory")
            if st is not None:
                self._share_dir(dfd, name, mode, uid, gid)
                os.fsync(dfd)
                return False
            tmp = self.temp_name()
            os.mkdir(tmp, 0o700, dir_fd=dfd)
            made = True
            try:
                self._set_dir_owner_mode(dfd, tmp, mode, uid, gid)
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError as e:
                self._rmdir_quietly(dfd, tmp)
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # another node made it meanwhile, and put something in it: share it
                made = False
                self._share_dir(dfd, name, mode, uid, gid)
            except BaseException:
                self._rmdir_quietly(dfd, tmp)
                raise
            os.fsync(dfd)
            return made

    def _set_dir_owner_mode(self, dfd: int, name: bytes, mode: int, uid: int, gid: int) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            self._set_owner_mode(fd, mode, uid, gid)
        finally:
            os.close(fd)

    def _share_dir(self, dfd: int, name: bytes, mode: int, uid: int, gid: int) -> None:
        """A directory that is there already (another node's, the same step): it gets this
        mount's owner and mode where this daemon may set them, and is used as it is where
        not (another user's daemon made it)."""
        try:
            self._set_dir_owner_mode(dfd, name, mode, uid, gid)
        except PermissionError:
            log.info("directory %r belongs to another user: used with its own owner and mode",
                     os.fsdecode(name))

    @staticmethod
    def _rmdir_quietly(dfd: int, name: bytes) -> None:
        try:
            os.rmdir(name, dir_fd=dfd)
        except OSError:
            pass

    def symlink(self, comps: Comps, name: bytes, target: bytes, uid: int, gid: int) -> None:
        check_name(name)
        with self.dir(comps) as dfd:
            try:
                os.symlink(target, name, dir_fd=dfd)
            except FileExistsError:
                if os.readlink(name, dir_fd=dfd) != target:
                    raise
            if IS_ROOT:
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
            os.fsync(dfd)

    def mknod(self, comps: Comps, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> None:
        """Make a FIFO, socket or device node with its owner and mode at once: made under a
        temporary name (mode 0), given its owner and mode, renamed into place."""
        check_name(name)
        with self.dir(comps) as dfd:
            tmp = self.temp_name()
            os.mknod(tmp, statmod.S_IFMT(mode), rdev, dir_fd=dfd)
            try:
                if IS_ROOT:
                    os.chown(tmp, uid, gid, dir_fd=dfd, follow_symlinks=False)
                _chmod_by_name(dfd, tmp, mode)
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                os.unlink(tmp, dir_fd=dfd)
                raise
            os.fsync(dfd)

    def unlink(self, comps: Comps, name: bytes, is_dir: bool) -> None:
        """Remove an entry; a missing entry (or directory) counts as removed: same result."""
        check_name(name)
        with self.dir(comps, absent=MissingDir) as dfd:
            if dfd is None:
                return
            try:
                if is_dir:
                    self._rmdir(dfd, name)
                else:
                    os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            os.fsync(dfd)

    def _rmdir(self, dfd: int, name: bytes) -> None:
        try:
            os.rmdir(name, dir_fd=dfd)
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
            # Only this daemon's temporary files, or its dead predecessor's, may be removed
            # with it; anything else (another daemon's upload in flight, a file someone else
            # put there) means the directory is not empty, and we refuse to delete it.
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            others = []
            try:
                for ent in os.listdir(sub):
                    if self.owns(os.fsencode(ent)):
                        try:
                            os.unlink(ent, dir_fd=sub)
                        except IsADirectoryError:   # a mkdir cut short
                            os.rmdir(ent, dir_fd=sub)
                    else:
                        others.append(os.fsencode(ent))
            finally:
                os.close(sub)
            try:
                os.rmdir(name, dir_fd=dfd)
            except OSError as e2:
                if e2.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise NotEmpty(name, others) from None
                raise

    def rename(self, scomps: Comps, sname: bytes, dcomps: Comps, dname: bytes) -> None:
        check_name(sname)
        check_name(dname)
        with self._two_dirs(scomps, dcomps) as (sfd, dfd):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            if dfd != sfd:
                os.fsync(sfd)

    def link(self, scomps: Comps, sname: bytes, dcomps: Comps, dname: bytes) -> None:
        """A hard link to the entry at ``scomps``/``sname`` as ``dcomps``/``dname``, replacing
        what stands there in one step: linked under a temporary name, renamed over."""
        check_name(sname)
        check_name(dname)
        with self._two_dirs(scomps, dcomps) as (sfd, dfd):
            tmp = self.temp_name()
            os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            try:
                os.rename(tmp, dname, src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                # rename(2) of a link over another link of the same file does nothing
                self.remove_temp(dfd, tmp)
            os.fsync(dfd)

    def setattr(self, comps: Comps, name: bytes, by_name: bool, mode: int | None, uid: int | None,
                gid: int | None, times: tuple[int, int] | None) -> None:
        """``by_name``: a symlink or special file, changed by name (opening a device node
        would open the device); else the file is opened (O_NONBLOCK, never a symlink)."""
        check_name(name)
        with self.dir(comps) as dfd:
            if by_name:
                if IS_ROOT and (uid is not None or gid is not None):
                    os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid,
                             dir_fd=dfd, follow_symlinks=False)
                if mode is not None:
                    _chmod_by_name(dfd, name, mode)
                if times is not None:
                    os.utime(name, ns=times, dir_fd=dfd, follow_symlinks=False)
                return
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            try:
                if uid is not None or gid is not None:
                    self._chown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
                if mode is not None:
                    os.fchmod(fd, statmod.S_IMODE(mode))
                if times is not None:
                    os.utime(fd, ns=times)
                os.fsync(fd)
            finally:
                os.close(fd)

    def set_xattr(self, comps: Comps, name: bytes, key: bytes, value: bytes | None) -> None:
        with self.dir(comps) as dfd:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            try:
                self._apply_xattrs(fd, [(key, value)])
            finally:
                os.close(fd)

    def _aside_dir(self, stamp: bytes, top: bytes) -> tuple[int, bytes]:
        """Open ``<top>/<stamp>``; returns its descriptor and the top folder used (made private if new), never through a symlink. ``top`` is
        shared by the daemons of every node and user (sticky and world-writable, as /tmp);
        if something else stands under its name, ``<top>-<instance>`` is used instead."""
        check_name(stamp)
        for t in (top, top + b"-" + self.instance.encode()):
            try:
                with self.dir([]) as rfd:
                    try:
                        os.mkdir(t, 0o700, dir_fd=rfd)
                        os.chmod(t, 0o1777, dir_fd=rfd)
                    except FileExistsError:
                        pass
                with self.dir([t]) as tfd:
                    try:
                        os.mkdir(stamp, 0o700, dir_fd=tfd)
                    except FileExistsError:
                        pass
                return self.open_dir([t, stamp]), t
            except MissingDir as e:
                if not e.blocked or e.depth != 0:
                    raise
                log.warning("%r in the backing is not a directory: keeping aside in %r instead",
                            os.fsdecode(t), os.fsdecode(top + b"-" + self.instance.encode()))
        raise MissingDir([t], 0, blocked=True)

    @staticmethod
    def _free_name(dfd: int, name: bytes) -> bytes:
        """``name``, or ``name~N`` if taken: content kept aside never replaces other content."""
        check_name(name)
        candidate, n = name, 0
        while True:
            try:
                os.stat(candidate, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return candidate
            n += 1
            candidate = name + b"~%d" % n

    def move_aside(self, comps: Comps, name: bytes, stamp: bytes, flat: bytes) -> str:
        """Move the entry at ``comps``/``name`` (another writer's, in the way of this
        node's) to ``.acpfs-conflicts/<stamp>/<flat>``; returns that path."""
        check_name(name)
        afd, top = self._aside_dir(stamp, CONFLICTS_DIR)
        try:
            with self.dir(comps) as dfd:
                flat = self._free_name(afd, flat)
                os.rename(name, flat, src_dir_fd=dfd, dst_dir_fd=afd)
                os.fsync(afd)
                os.fsync(dfd)
        finally:
            os.close(afd)
        return os.fsdecode(b"/".join((top, stamp, flat)))

    def empty_dir(self, comps: Comps, name: bytes) -> bool:
        """Whether the directory at ``comps``/``name`` has no entries (a rename over it
        replaces it in one step, as rename(2) does)."""
        check_name(name)
        with self.dir(comps) as dfd:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                with os.scandir(fd) as it:
                    return next(it, None) is None
            finally:
                os.close(fd)

    def _chown(self, fd: int, uid: int, gid: int) -> None:
        if IS_ROOT:
            os.fchown(fd, uid, gid)

    def _set_owner_mode(self, fd: int, mode: int, uid: int, gid: int) -> None:
        self._chown(fd, uid, gid)
        os.fchmod(fd, statmod.S_IMODE(mode))

    def _apply_xattrs(self, fd: int, items: list[tuple[bytes, bytes | None]]) -> None:
        try:
            for key, value in items:
                if value is None:
                    try:
                        os.removexattr(fd, key)
                    except OSError as e:
                        if e.errno != errno.ENODATA:
                            raise
                else:
                    os.setxattr(fd, key, value)
        except OSError as e:
            if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            if not self._xattr_warned:
                self._xattr_warned = True
                log.warning("the backing directory does not support user extended attributes; "
                            "they are kept in the mount only")


def _chmod_by_name(dfd: int, name: bytes, mode: int) -> None:
    """chmod ``name`` in ``dfd`` without following a symlink or opening the file (an O_PATH
    descriptor); a symlink's mode is left as it is (Linux has none to set)."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        if not statmod.S_ISLNK(os.fstat(fd).st_mode):
            os.chmod(f"/proc/self/fd/{fd}", statmod.S_IMODE(mode))
    finally:
        os.close(fd)
