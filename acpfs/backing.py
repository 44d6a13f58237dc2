"""The backing directory: every system call acpfs makes on it lives here.

Safety invariant (contract 9): the daemon never follows a symlink or ``..`` out of the
backing root. Paths are never handed to the kernel as strings: each directory is reached
from a file descriptor of the root with ``openat(O_NOFOLLOW | O_DIRECTORY)`` one name at a
time, names ``.``, ``..`` and names with ``/`` are refused, and every other call is relative
to such a directory descriptor with ``follow_symlinks=False`` where the call follows.

Atomicity invariant (contract 3): file content reaches a final name only through
``write_temp`` (temporary name in the same directory, data, owner, mode, times, fsync)
followed by ``publish`` (rename over the final name, fsync of the directory).

Boundary invariant: this is the only module that makes system calls on the backing
directory or on descriptors opened in it (reads, writes, truncates and fsyncs of staged
files included), so a test can wrap a ``Backing`` to fail or hang any one call
(tests/unit/faulty.py). Nothing here retries or knows about the cache; callers
(``flusher``, ``writethrough``, ``recovery``) do that.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import stat as statmod
import threading
import time
import urllib.parse
from typing import Iterable, Iterator

from .content import copy_fd

log = logging.getLogger(__name__)

TEMP_PREFIX = b".acpfs-tmp-"
# Temporary names: ``.acpfs-tmp-<instance>-<random>``, where <instance> names one daemon
# (``new_instance``: random, new at every start, kept in its journal) and <random> is 16 hex
# digits from the system's CSPRNG. Nobody can predict a name, a daemon can tell its own
# temporary files (and those of the dead daemon it recovers) from anyone else's, and it
# never opens, reuses, renames or deletes another one (contract 9, issue 10.5).
# Files written through (too large for the cache) are staged in the daemon's own staging
# directory at the backing root, ``.acpfs-tmp-<instance>-staging``, so that renaming or
# removing their directory on the mount never touches them; the final rename into place is
# still atomic (same filesystem). Their names end in ``-i<inode>`` (recovery matches them to
# files open at a crash). Versions before instance names staged files in one directory:
OLD_STAGING_DIR = TEMP_PREFIX + b"spill"
OLD_STAGED = re.compile(re.escape(TEMP_PREFIX) + rb"(\d+)-w\d+")
STAGED = re.compile(re.escape(TEMP_PREFIX) + rb"([0-9a-f]+)-[0-9a-f]+-i(\d+)")
RECOVERED_DIR = b".acpfs-recovered"   # content acpfs could not put in place, kept aside
CONFLICTS_DIR = b".acpfs-conflicts"   # entries of other writers moved out of the way (conflicts.py)
NODES_DIR = b".acpfs-nodes"           # one record per node sharing the backing (peers.py)
IS_ROOT = os.geteuid() == 0
# what a descriptor of a backing that went away and came back (a remounted NFS, SFS or FUSE
# store) answers: the root and every directory must be opened again by path
STALE = frozenset({errno.ENOTCONN, errno.ESTALE, errno.ENODEV})

Comps = list[bytes]


class MissingDir(OSError):
    """A directory on the way to a path is not in the backing (ENOENT): removed or moved
    behind acpfs's back. ``comps[:depth]`` were found; ``comps[depth]`` was not, or
    (``blocked``) something else, not a directory, stands under its name."""

    def __init__(self, comps: Comps, depth: int, blocked: bool = False) -> None:
        where = os.fsdecode(b"/".join(comps[:depth + 1]))
        why = "is not a directory in" if blocked else "is missing from"
        super().__init__(errno.ENOENT, f"directory {where!r} {why} the backing")
        self.comps = comps
        self.depth = depth
        self.blocked = blocked


class NotEmpty(OSError):
    """An rmdir found entries this daemon did not put there (``entries``: their names)."""

    def __init__(self, name: bytes, entries: list[bytes]) -> None:
        super().__init__(errno.ENOTEMPTY, f"directory {os.fsdecode(name)!r} is not empty")
        self.entries = entries


def flat_name(path: str) -> bytes:
    """A path as one file name for ``.acpfs-recovered/<time>-<instance>/`` or
    ``.acpfs-conflicts/...`` ("/" as %2F): within NAME_MAX, with a digest of the whole path
    where it had to be cut."""
    flat = urllib.parse.quote(path, safe="").encode()
    if len(flat) > 200:
        flat = flat[:160] + b"~" + hashlib.sha1(flat).hexdigest()[:16].encode()
    return flat


def is_internal_name(name: bytes) -> bool:
    """A name acpfs keeps for itself, hidden from the mount: temporary files, node records."""
    return name.startswith(TEMP_PREFIX) or name == NODES_DIR


def new_instance() -> str:
    """A fresh daemon identity for temporary names (48 random bits)."""
    return secrets.token_hex(6)


def staging_dir_of(tmpname: bytes) -> bytes:
    """The staging directory that holds the staged file ``tmpname``."""
    m = STAGED.fullmatch(tmpname)
    return TEMP_PREFIX + m.group(1) + b"-staging" if m else OLD_STAGING_DIR


def staged_ino(tmpname: bytes) -> int | None:
    """The inode number a staged file's name carries (None for other names)."""
    m = STAGED.fullmatch(tmpname) or OLD_STAGED.fullmatch(tmpname)
    return int(m.group(m.lastindex)) if m else None


def check_name(name: bytes) -> None:
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise OSError(errno.EINVAL, f"invalid name {name!r}")


class Backing:
    """The backing directory of one daemon ``instance``; ``dead_instance`` is the daemon
    whose journal this one recovers (its leftovers are this daemon's to clean up)."""

    def __init__(self, root: str, instance: str | None = None, dead_instance: str | None = None) -> None:
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # A backing that is itself a mount (NFS, SFS, a FUSE store) can go away and be mounted
        # again at the same path; its descriptors then answer ENOTCONN/ESTALE/ENODEV, and the
        # root is opened again by path (``reopen``), but only once a filesystem is mounted
        # there again: never the empty directory under it.
        self._root_is_mount = self._is_mount_point(self.root_fd)
        self._old_roots: list[int] = []   # closed at close(): another thread may hold one
        self._reopen_lock = threading.Lock()
        self.reopened = 0
        self.last_reopen: dict | None = None
        self._xattr_warned = False
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

    def close(self) -> None:
        for fd in [self.root_fd, *self._old_roots]:
            os.close(fd)

    # -- a backing that went away and came back -------------------------------------------
    def _is_mount_point(self, fd: int) -> bool:
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            return os.fstat(parent).st_dev != os.fstat(fd).st_dev
        finally:
            os.close(parent)

    def reopen(self, why: BaseException) -> bool:
        """The root descriptor went stale (``why``): open the root again by path. True if it
        was; False while nothing is mounted there again (the caller retries later)."""
        stale = self.root_fd
        with self._reopen_lock:
            if self.root_fd != stale:
                return True                    # another thread did it meanwhile
            try:
                os.fstat(self.root_fd)
                return True                    # the root is fine: another descriptor was stale
            except OSError:
                pass
            try:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                log.warning("the backing %s is not reachable (%s); trying again later", self.root, e)
                return False
            try:
                if self._root_is_mount and not self._is_mount_point(fd):
                    log.warning("the backing %s is not mounted again yet (%s); trying again later",
                                self.root, why)
                    os.close(fd)
                    return False
            except OSError:
                os.close(fd)
                return False
            self._old_roots.append(self.root_fd)
            self.root_fd = fd
            self.reopened += 1
            self.last_reopen = {"at": round(time.time(), 3), "why": str(why)}
            log.warning("the backing %s went away and is back (%s): opened it again by path",
                        self.root, why)
            return True

    def _stale_retry(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in STALE or not self.reopen(e):
                raise
            return fn(*args)

    # -- reaching directories -------------------------------------------------------------
    def open_dir(self, comps: Comps) -> int:
        """Open the directory at ``comps`` (names from the root) without following symlinks.
        Raises MissingDir when a component does not exist. A stale root is opened again."""
        return self._stale_retry(self._open_dir, comps)

    def _open_dir(self, comps: Comps) -> int:
        # a new open file description, not a dup: a listing reads from its own offset (a
        # dup shares the root's, and a second listing of the root came back empty), and a
        # stale root shows here
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            for depth, name in enumerate(comps):
                check_name(name)
                try:
                    nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  dir_fd=fd)
                except FileNotFoundError:
                    raise MissingDir(comps, depth) from None
                except OSError as e:
                    if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    raise MissingDir(comps, depth, blocked=True) from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def exists(self, comps: Comps, name: bytes) -> bool:
        """Is there an entry ``name`` in the directory at ``comps``?"""
        check_name(name)
        try:
            dfd = self.open_dir(comps)
        except MissingDir:
            return False
        try:
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(dfd)

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

    @staticmethod
    def version(dfd: int, name: bytes) -> tuple[int, int, int]:
        """(inode, size, mtime) of a file: what tells another writer's version from ours."""
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def stat_entry(self, comps: Comps, name: bytes) -> os.stat_result | None:
        """lstat of an entry; None if it (or its directory) is gone."""
        check_name(name)
        try:
            dfd = self.open_dir(comps)
        except MissingDir:
            return None
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(dfd)

    def temp_exists(self, dfd: int, tmpname: bytes) -> bool:
        """Is the temporary file still there? (False also when its directory is gone.)"""
        try:
            os.stat(tmpname, dir_fd=dfd, follow_symlinks=False)
            return True
        except OSError as e:
            if e.errno in STALE or e.errno in (errno.ENOENT, errno.EBADF):
                return False
            raise

    def listdir(self, comps: Comps) -> list[tuple[bytes, os.stat_result, bytes | None]]:
        """(name, lstat result, symlink target) of each entry, without acpfs temporary files.

        Uploads the dead daemon this one recovered from left half-written are removed; those
        of any other daemon (other nodes' included) are left alone.
        """
        fd = self.open_dir(comps)
        try:
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
        finally:
            os.close(fd)

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

    def stat_root(self) -> os.stat_result:
        return self._stale_retry(lambda: os.fstat(self.root_fd))

    def statvfs(self) -> os.statvfs_result:
        return self._stale_retry(lambda: os.fstatvfs(self.root_fd))

    def open_file(self, comps: Comps, name: bytes) -> int:
        """Open a regular file of the backing for reading (never through a symlink)."""
        check_name(name)
        dfd = self.open_dir(comps)
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)

    def open_version(self, comps: Comps, name: bytes,
                     version: tuple[int, int, int] | None) -> tuple[int, os.stat_result]:
        """Open a regular file of the backing for reading, with the fstat of what was opened.
        With ``version`` ((inode, size, mtime) of the copy the caller knows), another version
        found under the name is ``ESTALE``: nothing is ever read from a file that replaced
        the one whose size the mount reports (docs/semantics.md, section 10)."""
        fd = self.open_file(comps, name)
        try:
            st = os.fstat(fd)
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
        more names in the backing than the mount knows (Flusher._unknown_names)."""
        out: list[tuple[Comps, bytes]] = []
        stack: list[Comps] = [[]]
        while stack and len(out) < want:
            comps = stack.pop()
            try:
                fd = self.open_dir(comps)
            except (MissingDir, PermissionError):
                continue
            try:
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
            finally:
                os.close(fd)
        return out[:want]

    def dir_version(self, comps: Comps) -> tuple[int, int, int] | None:
        """(inode, mtime, ctime) of a directory: any entry made or removed in it changes them
        (to the resolution of the backing's clock). None if it is gone."""
        try:
            fd = self.open_dir(comps)
        except MissingDir:
            return None
        try:
            st = os.fstat(fd)
            return st.st_ino, st.st_mtime_ns, st.st_ctime_ns
        finally:
            os.close(fd)

    def read_xattrs(self, comps: Comps, name: bytes | None) -> dict[bytes, bytes]:
        """User extended attributes of a file or directory (``name`` None: the directory itself)."""
        try:
            dfd = self.open_dir(comps)
        except OSError:
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
        finally:
            os.close(dfd)

    # -- namespace operations (each followed by an fsync of the directories it changed) ---
    def mkdir(self, comps: Comps, name: bytes, mode: int, uid: int, gid: int) -> bool:
        """Make a directory with its owner and mode at once: made private under a temporary
        name, given its owner and mode, renamed into place (nobody sees it with another
        mode or owner). An existing directory of that name gets the owner and mode.
        Returns whether this call made it (False: it was there, or another writer made it
        meanwhile)."""
        check_name(name)
        dfd = self.open_dir(comps)
        try:
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
        finally:
            os.close(dfd)

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
        dfd = self.open_dir(comps)
        try:
            try:
                os.symlink(target, name, dir_fd=dfd)
            except FileExistsError:
                if os.readlink(name, dir_fd=dfd) != target:
                    raise
            if IS_ROOT:
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def mknod(self, comps: Comps, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> None:
        """Make a FIFO, socket or device node with its owner and mode at once: made under a
        temporary name (mode 0), given its owner and mode, renamed into place."""
        check_name(name)
        dfd = self.open_dir(comps)
        try:
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
        finally:
            os.close(dfd)

    def read_link(self, comps: Comps, name: bytes) -> bytes | None:
        """The target of a symlink; None if it is gone or not a symlink."""
        check_name(name)
        dfd = self.open_dir(comps)
        try:
            return os.readlink(name, dir_fd=dfd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EINVAL):
                return None
            raise
        finally:
            os.close(dfd)

    def unlink(self, comps: Comps, name: bytes, is_dir: bool) -> None:
        """Remove an entry; a missing entry (or directory) counts as removed: same result."""
        check_name(name)
        try:
            dfd = self.open_dir(comps)
        except MissingDir:
            return
        try:
            try:
                if is_dir:
                    self._rmdir(dfd, name)
                else:
                    os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            os.fsync(dfd)
        finally:
            os.close(dfd)

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

    @contextlib.contextmanager
    def _two_dirs(self, scomps: Comps, dcomps: Comps) -> Iterator[tuple[int, int]]:
        """Descriptors of two directories (one, twice, if they are the same), closed after."""
        sfd = self.open_dir(scomps)
        try:
            dfd = self.open_dir(dcomps) if dcomps != scomps else sfd
            try:
                yield sfd, dfd
            finally:
                if dfd != sfd:
                    os.close(dfd)
        finally:
            os.close(sfd)

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
        dfd = self.open_dir(comps)
        try:
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
        finally:
            os.close(dfd)

    def set_xattr(self, comps: Comps, name: bytes, key: bytes, value: bytes | None) -> None:
        dfd = self.open_dir(comps)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            try:
                self._apply_xattrs(fd, [(key, value)])
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    # -- file content ------------------------------------------------------------------
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

    def publish(self, src_dfd: int, tmpname: bytes, dst_dfd: int, name: bytes) -> None:
        """Atomically move a complete temporary file over its final name."""
        check_name(name)
        os.rename(tmpname, name, src_dir_fd=src_dfd, dst_dir_fd=dst_dfd)
        os.fsync(dst_dfd)
        if dst_dfd != src_dfd and not os.path.samestat(os.fstat(src_dfd), os.fstat(dst_dfd)):
            os.fsync(src_dfd)

    # -- descriptors opened here (backing copies being read, staged files) ----------------
    def read(self, fd: int, size: int, off: int) -> bytes:
        return os.pread(fd, size, off)

    def read_into(self, fd: int, buf: memoryview, off: int) -> int:
        return os.preadv(fd, [buf], off)

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

    # -- the staging directory, as recovery finds it ---------------------------------------
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
        """Staged files the dead daemon left in its staging directory (the one directory
        of versions before instance names, if it died with no instance)."""
        where = self.dead + b"staging" if self.dead is not None else OLD_STAGING_DIR
        try:
            dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=self.root_fd)
        except FileNotFoundError:
            return []
        try:
            return [n for n in map(os.fsencode, os.listdir(dfd)) if staged_ino(n) is not None]
        finally:
            os.close(dfd)

    def remove_leftover_staging_dir(self) -> None:
        """Remove the dead daemon's staging directory if it is empty."""
        self._remove_dir(self.dead + b"staging" if self.dead is not None else OLD_STAGING_DIR)

    def remove_staged(self, tmpname: bytes) -> None:
        check_name(tmpname)
        try:
            os.unlink(staging_dir_of(tmpname) + b"/" + tmpname, dir_fd=self.root_fd)
        except FileNotFoundError:
            pass

    def _aside_dir(self, stamp: bytes, top: bytes) -> tuple[int, bytes]:
        """Open ``<top>/<stamp>``; returns its descriptor and the top folder used (made private if new), never through a symlink. ``top`` is
        shared by the daemons of every node and user (sticky and world-writable, as /tmp);
        if something else stands under its name, ``<top>-<instance>`` is used instead."""
        check_name(stamp)
        for t in (top, top + b"-" + self.instance.encode()):
            try:
                rfd = self.open_dir([])
                try:
                    try:
                        os.mkdir(t, 0o700, dir_fd=rfd)
                        os.chmod(t, 0o1777, dir_fd=rfd)
                    except FileExistsError:
                        pass
                finally:
                    os.close(rfd)
                tfd = self.open_dir([t])
                try:
                    os.mkdir(stamp, 0o700, dir_fd=tfd)
                except FileExistsError:
                    pass
                finally:
                    os.close(tfd)
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
            dfd = self.open_dir(comps)
            try:
                flat = self._free_name(afd, flat)
                os.rename(name, flat, src_dir_fd=dfd, dst_dir_fd=afd)
                os.fsync(afd)
                os.fsync(dfd)
            finally:
                os.close(dfd)
        finally:
            os.close(afd)
        return os.fsdecode(b"/".join((top, stamp, flat)))

    def remove_empty_dir(self, comps: Comps, name: bytes) -> bool:
        """rmdir; False if the directory is not empty."""
        check_name(name)
        dfd = self.open_dir(comps)
        try:
            os.rmdir(name, dir_fd=dfd)
            os.fsync(dfd)
            return True
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        finally:
            os.close(dfd)

    # -- helpers -----------------------------------------------------------------------
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
