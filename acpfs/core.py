"""The filesystem's operations under trio, without FUSE: what each request does.

``fs`` turns a FUSE request into one call here and the result into a reply; tests call
these methods directly (tests/unit/test_core.py), with the real cache, flusher and a
backing that can fail or hang. Owns the open file and directory handles, loading of
directories and extended attributes from the backing (in worker threads, so that a slow
or hung backing never stalls the trio loop), reads of files that are not cached, preload,
statfs, and the control attributes (``control``). Everything that touches a file's content
while the cache is full goes through ``writethrough``; the namespace and cached content
are ``cache``'s.

Errors are ``types.FsError`` (an errno); anything else raised here is a bug.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat as statmod
import time
from typing import TYPE_CHECKING, Callable, NoReturn, Protocol, TypeVar

import trio

from . import control
from .config import format_size
from .backing import is_internal_name
from .cache import Relisting
from .content import CacheFull
from .oplog import UNIT
from .types import Node, err, name_path, node_path
from .writethrough import Background, WriteThrough

if TYPE_CHECKING:
    from .flusher import Flusher
    from .passthrough import Kernel
    from .peers import Peers

T = TypeVar("T")
FALLOC_FL_KEEP_SIZE = 0x01
log = logging.getLogger(__name__)

STATFS_WAIT = 2.0  # seconds statfs waits for the backing before answering from memory
# seconds a lookup, listing, open or stat waits for the backing to say what other nodes changed
# before it answers from what this mount knows (a hung backing must not block cached work)
COHERENCE_WAIT = 0.5


PRIV_BITS = statmod.S_ISUID | statmod.S_ISGID
NAME_MAX = 255   # bytes in one name, as every filesystem the backing may be on
PASSTHROUGH_LOOK = 0.5   # s between looks at the files writers passed through have written
UNSHARED_POLL = 0.005   # s between looks at a memory file an upload still holds (Core._unshared)
LATE_ACK = 0.5   # s: content acknowledged by a close() whose RELEASE has not come is queued


class Caller(Protocol):
    """Who made a request (pyfuse3's RequestContext has these)."""
    uid: int
    gid: int
    umask: int


class Handle:
    """An open file."""
    __slots__ = ("node", "writable", "append", "backing_fd", "backing_version", "kill_priv",
                 "passthrough", "opened_seq")

    def __init__(self, node: Node, writable: bool, append: bool = False,
                 kill_priv: bool = False, passthrough: bool = False) -> None:
        self.node = node
        self.writable = writable
        self.passthrough = passthrough   # the kernel reads and writes its memory file itself
        self.opened_seq = 0              # OpLog.seq at the open
        self.append = append         # opened with O_APPEND
        self.kill_priv = kill_priv   # opened by a user other than root: its writes clear setuid
        self.backing_fd = -1         # the backing copy, for files not in the cache
        self.backing_version = 0     # Node.versions when backing_fd was opened


class Core:
    def __init__(self, flusher: Flusher, info: control.MountInfo, *,
                 peers: Peers | None = None, kernel: Kernel | None = None,
                 direct_io_mmap: Callable[[], bool] = lambda: False,
                 invalidate_attrs: Callable[[int], None] = lambda ino: None) -> None:
        self.flusher = flusher   # status and the control attributes
        self.cache = cache = flusher.cache
        self.oplog = cache.oplog
        self.peers = peers     # global order (peers.py); None: off
        self.kernel = kernel   # passthrough (passthrough.py); None: every request comes here
        self.backing = cache.backing
        self.info = info
        self.background = Background()
        self.wt = WriteThrough(cache, self.background, info.cache_full_timeout,
                               info.persist_open_after)
        self.direct_io_mmap = direct_io_mmap   # asked at each open: the INIT reply decides
        # the kernel forgets an inode's attributes before this returns (only ever called for
        # the inode of the request being answered: the kernel holds it, never evicting it)
        self.invalidate_attrs = invalidate_attrs
        self.handles: dict[int, Handle] = {}
        self.dirs: dict[int, list[tuple[bytes, Node]]] = {}
        self._next_fh = 1
        self._list_locks: dict[int, trio.Lock] = {}
        self._checking: set[object] = set()   # inos and names with a check in a worker thread
        self.check_threads = trio.CapacityLimiter(8)   # checks stuck on a hung backing stop here
        self._statfs: os.statvfs_result | None = self.backing.statvfs()   # answers at mount
        self._statfs_call: trio.Event | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Background work: write-through in a full cache, files open for a long time,
        acknowledged content whose RELEASE does not come."""
        nursery.start_soon(self.background.run, nursery)
        nursery.start_soon(self.wt.persist_open_files)
        nursery.start_soon(self._queue_late_acks)
        if self.kernel is not None:
            nursery.start_soon(self._count_passthrough_writes)

    # -- resolving ids ---------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        node = self.cache.nodes.get(ino)
        if node is None:
            raise err(errno.ENOENT, f"inode {ino} is not known (forgotten)")
        return node

    def handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if h is None:
            raise err(errno.EBADF, f"file handle {fh} is not open")
        return h

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    # -- loading from the backing ----------------------------------------------------------
    async def loaded(self, node: Node) -> Node:
        """Make sure a directory's entries are known (read from the backing once)."""
        if node.children is None:
            if not node.is_dir:
                raise err(errno.ENOTDIR)
            lk = self._list_locks.get(node.ino)
            if lk is None:
                lk = self._list_locks[node.ino] = trio.Lock()
            async with lk:
                if node.children is None:
                    listing = await trio.to_thread.run_sync(self.cache.list_backing, node)
                    self.cache.attach_listing(node, listing)
            self._list_locks.pop(node.ino, None)
        return node

    async def xattrs_loaded(self, node: Node) -> dict[bytes, bytes]:
        if node.xattrs is None:
            cache = self.cache

            def read() -> dict[bytes, bytes]:
                with cache.position_lock:
                    if node is cache.root:
                        return cache.backing.read_xattrs([], None)
                    if node.backing_parent is None or node.is_link:
                        return {}
                    return cache.backing.read_xattrs(cache.backing_path(node.backing_parent),
                                                     node.backing_name)
            values = await trio.to_thread.run_sync(read)
            if node.xattrs is None:
                node.xattrs = values
        return node.xattrs

    async def dir(self, ino: int) -> Node:
        return await self.loaded(self.node(ino))

    async def refreshed(self, node: Node, at_open: bool = False) -> Node:
        """A loaded directory whose backing entries were merged in at most
        ``coherence_timeout`` seconds ago: other nodes' changes show (close-to-open
        coherence, as on NFS). ``at_open`` (opendir): also listed afresh at once when the
        backing directory's version changed since the last listing (one stat of it), as NFS
        revalidates a directory it opens. Only directories this mount has put in the backing
        are looked at again; one listing at a time per directory."""
        cache = self.cache
        timeout = self.info.coherence_timeout
        if not cache.present(node) or node.children is None or node.ino in self._checking \
                or (not at_open and time.monotonic() - node.listed_at <= timeout):
            return node
        lk = self._list_locks.get(node.ino)
        if lk is None:
            lk = self._list_locks[node.ino] = trio.Lock()
        async with lk:
            stale = time.monotonic() - node.listed_at > timeout
            if (stale or at_open) and cache.present(node) and node.ino not in self._checking:
                relist = functools.partial(cache.relist_backing, node, unless=None if stale else node.listed_version)
                got: Relisting | None | bool = False
                try:
                    with trio.move_on_after(COHERENCE_WAIT):
                        got = await self._check(node.ino, relist)
                except OSError as e:   # a failing backing: what this mount knows stands
                    log.debug("relisting %s: %s", node_path(node), e)
                if got is False:       # failing or not answering: look again after the timeout
                    if stale:
                        node.listed_at = time.monotonic()
                elif got is None:      # unchanged since the last listing
                    node.listed_at = time.monotonic()
                elif node.children is not None and (node.parent is not None or node is cache.root):
                    cache.merge_listing(node, *got)
        self._list_locks.pop(node.ino, None)
        return node

    async def found_elsewhere(self, parent: Node, name: bytes) -> Node:
        """A name this mount's view of ``parent`` lacks: looked up in the backing (one lstat,
        as NFS looks up a name it has no entry for), so that a file another node made is
        seen at once, not at the next listing. ENOENT if it is not there, or if this mount
        has a change of its own pending on the name (its removal wins in its own view)."""
        cache = self.cache
        key = (parent.ino, name)
        if is_internal_name(name) or not cache.present(parent) or key in self._checking:
            raise err(errno.ENOENT)
        got = None
        try:
            with trio.move_on_after(COHERENCE_WAIT):
                got = await self._check(key, functools.partial(cache.stat_name, parent, name))
        except OSError as e:
            log.debug("looking up %s in the backing: %s", name_path(parent, name), e)
        node = parent.children.get(name) if parent.children is not None else None
        if node is None and got is not None and parent.children is not None:
            node = cache.attach_found(parent, name, got)
        if node is None:
            raise err(errno.ENOENT)
        return node

    async def revalidated(self, node: Node, at_open: bool = False, forget: bool = True) -> Node:
        """A clean file whose backing copy was compared with this mount's at most
        ``coherence_timeout`` seconds ago (inode, size, mtime): a version another node
        published since replaces a stale cached copy and its attributes (close-to-open).

        ``at_open``: compared now, whenever it was last (close-to-open at every open, as
        NFS's GETATTR at open), and the kernel forgets the old attributes before the open is
        answered. A name whose backing entry is gone or another kind of entry, or another
        version of a file open here (its readers keep theirs), leaves this node: the open
        fails with ESTALE, on which the kernel looks the name up again and opens what the
        backing holds now (the old node lives on for the descriptors open on it)."""
        cache = self.cache
        if not node.is_reg or node.backing_parent is None \
                or (not at_open and time.monotonic() - node.checked_at <= self.info.coherence_timeout) \
                or node.ino in self._checking or not cache.quiescent(node):
            return node
        got = None
        node.checked_at = time.monotonic()   # failing or not answering: look again later
        try:
            with trio.move_on_after(COHERENCE_WAIT):
                got = await self._check(node.ino, functools.partial(cache.stat_backing, node))
        except OSError as e:
            log.debug("revalidating %s: %s", node_path(node), e)
            return node
        stats, applied = got if got is not None else ([], 0)
        if not stats or not cache.quiescent(node, applied) or node.backing_version is None:
            return node
        pos, st = stats[0]
        lost_name = False
        if at_open and not node.links and (node.parent, node.name) == pos \
                and (node.backing_parent, node.backing_name) == pos \
                and (st is None or not statmod.S_ISREG(st.st_mode)
                     or (node.opens and (st.st_ino, st.st_size, st.st_mtime_ns) != node.backing_version)):
            await self._leaves_view(pos[0], pos[1], node, gone=st is None)
        if st is not None and statmod.S_ISREG(st.st_mode) \
                and (node.backing_parent, node.backing_name) == pos \
                and (st.st_ino, st.st_size, st.st_mtime_ns) != node.backing_version:
            if not node.links or st.st_nlink >= len(node.names()):
                # a new version (another node republishes a linked file under every name)
                cache.replaced_elsewhere(node, st)
                if at_open and forget and node.opens == 0:
                    self.invalidate_attrs(node.ino)   # before the reader's first read
            else:
                # another file under this name alone: split off now at an open or lookup
                # (then ESTALE below), else by the listing of its directory at the next
                # lookup; never read or written as this file
                self._another_file_at(pos, node, st, at_open)
                lost_name = True
        # a file with several names: each of them, as close-to-open asks. A name another
        # node removed leaves the file (which keeps its others); one that holds another
        # file is split off. At an open, either answers ESTALE below
        for pos, st in stats if node.links else ():
            if node.position_at(*pos) is None or pos[0].children is None \
                    or pos[0].children.get(pos[1]) is not node or not node.links:
                continue
            if st is None:
                cache._removed_elsewhere(pos[0], pos[1], node)
                lost_name = True
            elif (st.st_ino, st.st_size, st.st_mtime_ns) != node.backing_version:
                self._another_file_at(pos, node, st, at_open)
                lost_name = True
        if at_open and lost_name:
            # the open may have come through the name that left: the kernel looks the
            # path up again, and opens the file, a new one, or nothing, as the backing has it
            raise err(errno.ESTALE, "another writer removed or replaced a name of the file")
        return node

    def _another_file_at(self, pos: tuple[Node, bytes], node: Node, st: os.stat_result,
                         at_open: bool) -> None:
        """A name of a file with several names holds another file in the backing now (another
        writer replaced that name alone): at an open or lookup it becomes that file in the
        view at once (``Cache.split``); otherwise the next lookup lists its directory."""
        if at_open and statmod.S_ISREG(st.st_mode) and node.links:
            self.cache.split(pos[0], pos[1], node, st)
        else:
            self._look_again(pos)

    async def _entry_checked(self, parent: Node, name: bytes, node: Node) -> None:
        """A directory, symlink or special file known under ``parent``/``name``, compared with
        the backing at a lookup: gone there, or another kind of entry there (another writer
        removed it, with all below it, or put something else in its place), it leaves the
        view (ESTALE; the name then holds what the backing has), unless this mount has a
        change of its own pending on it or below it."""
        cache = self.cache
        if node.ino in self._checking or node.backing_parent is not parent \
                or node.backing_name != name or node.parent is not parent or node.name != name:
            return
        got = None
        try:
            with trio.move_on_after(COHERENCE_WAIT):
                got = await self._check(node.ino, functools.partial(cache.stat_backing, node))
        except OSError as e:
            log.debug("looking at %s: %s", node_path(node), e)
        if got is None or not got[0]:
            return
        (pos, st), applied = got[0][0], got[1]
        if pos != (parent, name) or parent.children is None or parent.children.get(name) is not node \
                or not cache._subtree_quiescent(node, applied):
            return
        if st is None or statmod.S_IFMT(st.st_mode) != statmod.S_IFMT(node.mode):
            await self._leaves_view(parent, name, node, gone=st is None)

    async def _leaves_view(self, parent: Node, name: bytes, node: Node, gone: bool) -> NoReturn:
        """Another writer removed ``node``'s entry from the backing, or put another entry
        under its name: the node leaves the view (it lives on for descriptors open on it),
        the name holds what the backing has now (looked up as a missing name is), and the
        request answers ESTALE, on which the kernel looks the name up again."""
        self.cache._removed_elsewhere(parent, name, node)
        if not gone:
            try:
                await self.found_elsewhere(parent, name)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
        raise err(errno.ESTALE, "another writer removed or replaced the entry in the backing")

    def _look_again(self, pos: tuple[Node, bytes]) -> None:
        """The next lookup of this name lists its directory again (Cache.merge_listing)."""
        pos[0].listed_at = 0.0
        self.cache.kernel.forget_entry(pos[0].ino, pos[1])

    async def _check(self, key: object, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread that may be abandoned (a hung backing): at most one
        per ``key`` (an inode, a name) at a time, and at most ``check_threads`` in all, so
        that stuck checks never take the threads that cached work needs."""
        self._checking.add(key)
        started = []

        def job():
            started.append(True)
            try:
                return fn()
            finally:
                self._checking.discard(key)
        try:
            return await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=self.check_threads)
        finally:
            if not started:      # cancelled while waiting for a thread: it never ran
                self._checking.discard(key)

    async def getattr(self, ino: int) -> Node:
        node = await self.revalidated(self.node(ino))
        self.cache.sync_content(node)
        return node

    # -- the namespace ---------------------------------------------------------------------
    async def lookup(self, parent_ino: int, name: bytes) -> Node:
        node = await self._lookup(parent_ino, name)
        self.cache.sync_content(node)   # the reply's size must not undo a write passed through
        return node

    async def _lookup(self, parent_ino: int, name: bytes) -> Node:
        if len(name) > NAME_MAX:
            raise err(errno.ENAMETOOLONG, "name longer than 255 bytes")
        # another node may have made or removed it since this directory was last looked at
        parent = await self.refreshed(await self.dir(parent_ino))
        node = parent.children.get(name)  # type: ignore[union-attr]
        if node is None:
            return await self.found_elsewhere(parent, name)
        # The kernel asks only once its entry ran out, or to be sure (before a create, link,
        # mkdir or rename onto the name: LOOKUP_EXCL, LOOKUP_RENAME_TARGET): a clean file is
        # compared with the backing now, as at an open, so that a name another node removed
        # or replaced is not answered from this node's view (EEXIST for a name that is
        # gone). The reply carries the attributes, which the kernel then keeps.
        try:
            if node.is_reg:
                await self.revalidated(node, at_open=True, forget=False)
            else:
                await self._entry_checked(parent, name, node)
        except OSError as e:
            if e.errno != errno.ESTALE:
                raise
        node = parent.children.get(name)  # type: ignore[union-attr]   # what the check left there
        if node is None:
            raise err(errno.ENOENT)
        return node

    @staticmethod
    def _gid(parent: Node, caller: Caller) -> int:
        return parent.gid if parent.mode & statmod.S_ISGID else caller.gid

    async def mkdir(self, parent_ino: int, name: bytes, mode: int, caller: Caller) -> Node:
        parent = await self.dir(parent_ino)
        mode &= ~caller.umask
        if parent.mode & statmod.S_ISGID:
            mode |= statmod.S_ISGID   # inherited, as on a local filesystem
        return self.cache.mkdir(parent, name, mode, caller.uid, self._gid(parent, caller))

    async def symlink(self, parent_ino: int, name: bytes, target: bytes, caller: Caller) -> Node:
        parent = await self.dir(parent_ino)
        return self.cache.symlink(parent, name, target, caller.uid, self._gid(parent, caller))

    async def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, caller: Caller) -> Node:
        """mknod(2): a regular file (empty, queued at once), a FIFO, a socket, or a device
        node (the kernel lets only callers with CAP_MKNOD ask; the daemon makes it in the
        backing, so it must be root too)."""
        parent = await self.dir(parent_ino)
        kind = statmod.S_IFMT(mode) or statmod.S_IFREG
        perm = statmod.S_IMODE(mode) & ~caller.umask
        gid = self._gid(parent, caller)
        if kind == statmod.S_IFREG:
            node = self.cache.create(parent, name, perm, caller.uid, gid)
            self.cache.snapshot(node)
            return node
        if kind in (statmod.S_IFCHR, statmod.S_IFBLK) and os.geteuid() != 0:
            raise err(errno.EPERM, "device nodes need an acpfs daemon running as root")
        if kind not in (statmod.S_IFCHR, statmod.S_IFBLK, statmod.S_IFIFO, statmod.S_IFSOCK):
            raise err(errno.EINVAL)
        return self.cache.mknod(parent, name, kind | perm, rdev, caller.uid, gid)

    async def link(self, ino: int, parent_ino: int, name: bytes) -> Node:
        """link(2): one more name for a file (the kernel refuses directories and checks the
        caller's permissions; protected_hardlinks is the kernel's too)."""
        node = self.node(ino)
        self.cache.link(node, await self.dir(parent_ino), name)
        return node

    async def unlink(self, parent_ino: int, name: bytes) -> None:
        """unlink(2). The kernel sends it for a name it may know from before another node's
        change (within its entry timeout): a clean file is compared with the backing first,
        as a lookup would, so that the name is removed whichever version it holds now (as
        an NFS server removes the name), never kept as 'newer than this node's'."""
        parent = await self.dir(parent_ino)
        node = parent.children.get(name)  # type: ignore[union-attr]
        if node is not None and node.is_reg:
            try:
                await self.revalidated(node, at_open=True, forget=False)
            except OSError as e:
                if e.errno != errno.ESTALE:
                    raise
        self.cache.unlink(parent, name)

    async def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = await self.dir(parent_ino)
        await self.loaded(self.cache.lookup(parent, name))
        self.cache.rmdir(parent, name)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     noreplace: bool) -> None:
        p1 = await self.dir(old_parent)
        p2 = await self.dir(new_parent)
        target = p2.children.get(new_name)  # type: ignore[union-attr]
        if target is not None and target.is_dir:
            await self.loaded(target)
        self.cache.rename(p1, old_name, p2, new_name, noreplace=noreplace)

    def readlink(self, ino: int) -> bytes:
        node = self.node(ino)
        if not node.is_link:
            raise err(errno.EINVAL, "not a symlink")
        return node.target

    def forget(self, ino: int, n: int) -> None:
        node = self.cache.nodes.get(ino)
        if node is not None and node is not self.cache.root:
            self.cache.forget(node, n)

    async def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None, atime: int | None = None,
                      mtime: int | None = None, caller_uid: int = 0) -> Node:
        node = self.node(ino)
        if size is not None:
            if not node.is_reg:
                raise err(errno.EINVAL, "not a regular file")
            await self.xattrs_loaded(node)
            self.cache.sync_content(node)
            while not await self._unshared(node, size == 0):
                pass
            await self.wt.truncate(node, size)
        if (mode, uid, gid, atime, mtime) != (None,) * 5:
            self.cache.setattr(node, mode=mode, uid=uid, gid=gid, atime=atime, mtime=mtime)
        # with FUSE_HANDLE_KILLPRIV_V2 the kernel leaves this to us: a truncate by a user
        # other than root, and a change of owner of anything but a directory (a fifo or a
        # device too, as chown(2) on Linux)
        if mode is None and not node.is_dir and node.mode & PRIV_BITS and (
                (size is not None and caller_uid != 0) or uid is not None or gid is not None):
            self.kill_priv(node, chown=True)     # the reply carries the new mode
        return node

    # -- directories -----------------------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        node = await self.refreshed(await self.dir(ino), at_open=True)
        fh = self._new_fh()
        self.dirs[fh] = list(node.children.items())  # type: ignore[union-attr]
        return fh

    def dir_entries(self, fh: int) -> list[tuple[bytes, Node]]:
        entries = self.dirs.get(fh)
        if entries is None:
            raise err(errno.EBADF, f"directory handle {fh} is not open")
        return entries

    def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    async def fsyncdir(self) -> None:
        if self.info.fsync_backing:
            await self.wt.wait_seq(self.cache.oplog.seq)

    # -- files -----------------------------------------------------------------------------
    async def open(self, ino: int, flags: int, uid: int = 0) -> tuple[int, bool, int]:
        """Open a file: (file handle, whether the kernel should bypass its page cache, the
        backing id the kernel passes the file through to, or 0)."""
        node = await self.revalidated(self.node(ino), at_open=True)
        if node.is_dir:
            raise err(errno.EISDIR)
        if node.parent is None and node.content is None and node.staged is None \
                and node.backing_parent is None:
            # another writer removed it and a listing took it out of the view while the
            # kernel still held its name: the kernel looks the name up again
            raise err(errno.ESTALE, "another writer removed the file in the backing")
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC) and writable
        append = bool(flags & os.O_APPEND)
        await self.wt.settle(node)
        if writable:
            await self.xattrs_loaded(node)
            while True:   # until the content is cached or staged, and private, at once
                await self.wt.open_for_writing(node, trunc)
                if await self._unshared(node, trunc):
                    break
        # direct_io only where shared mmap survives it (the kernel granted it in INIT:
        # Linux 6.9+ with the fast write extension; elsewhere a shared writable mapping of a
        # direct_io file fails with ENODEV, which breaks SQLite's WAL and np.memmap).
        # There, writers get it (1 MiB requests straight into the cache, no page cache cap),
        # and readers of a cached file (one copy from the cache into the reader's buffer,
        # where the page cache copies twice and allocates a page per 4 KiB). Files read
        # from the backing keep the page cache and its read-ahead, except beside
        # passthrough, where a file must not enter the page cache's mode.
        backing_id = self._passthrough(node, writable)
        direct = self.direct_io_mmap() and (writable or node.content is not None
                                            or self.kernel is not None)
        h = Handle(node, writable, append, kill_priv=writable and uid != 0,
                   passthrough=bool(backing_id))
        h.opened_seq = self.cache.oplog.seq
        if not writable and node.content is None and node.staged is None and node.is_reg:
            # Open the backing copy now, so that the reader keeps the version it opened
            # even if the file is renamed over, deleted or republished meanwhile.
            await self._open_backing(h, verify=True)
        self.cache.open(node, writable, trunc, append and writable, passthrough=h.passthrough)
        if h.kill_priv and node.mode & PRIV_BITS and (trunc or h.passthrough):
            # O_TRUNC by a user other than root clears them (the kernel leaves that to the
            # daemon with FUSE_HANDLE_KILLPRIV_V2), and so would a write passed through,
            # which never comes here: cleared at the open
            self.kill_priv(node)
        if h.passthrough and writable:
            self.cache.note_change(node)   # its first write never comes here: dirty from the open
        fh = self._new_fh()
        self.handles[fh] = h
        return fh, direct and not backing_id, backing_id

    def _passthrough(self, node: Node, writable: bool) -> int:
        """The backing id an open of ``node`` is passed through to, or 0 for an open the
        daemon serves. The kernel fails an open with EIO when an inode has opens of both
        kinds (or two backing files), so every open of a file open with passthrough is
        passed through to the same memory file, and a file open through the daemon stays so
        until its last close. A writer is passed through only while the cache has headroom
        (its writes are counted only when the daemon next looks); else it takes the daemon's
        path, where a full cache makes it wait or write through to the backing."""
        kernel, cache = self.kernel, self.cache
        if kernel is None or not node.is_reg or node.content is None or node.staged is not None:
            return 0
        if node.passthrough_opens:
            return node.content.backing_id
        if node.opens or not kernel.granted():
            return 0
        if writable and not cache.headroom(node):
            return 0
        try:
            return cache.store.backing(node.content, kernel.register)
        except OSError as e:
            log.warning("%s: cannot pass it through (%s); served by the daemon", node_path(node), e)
            return 0

    async def _unshared(self, node: Node, trunc: bool) -> bool:
        """Before an open for writing: content a snapshot or journal record still holds is
        copied, so that the kernel writes a memory file nobody else reads. Not while the
        file is open with passthrough: the kernel holds that memory file, so the writer
        waits until the upload that holds it lands. Returns True when nothing was waited
        for; after a wait everything the caller checked may have changed (look again)."""
        cache, store = self.cache, self.cache.store
        content = node.content
        if content is None or not store.shared(content):
            return True
        if node.ino in self.wt.slots:
            await self.wt.settle(node)
        elif node.passthrough_opens:
            await self.wt.wait_seq(node.last_seq)
            await trio.sleep(UNSHARED_POLL)   # the upload's reference goes just after its seq
        else:
            # copied in a worker thread with the slot held: no open passes through to the
            # old memory file meanwhile (Core.open settles first)
            size = 0 if trunc else node.size     # O_TRUNC: nothing worth copying
            async with self.wt.hold(node, "copy for a writer"):
                copy = await trio.to_thread.run_sync(store.copy, content, size)
                with cache.oplog.lock:
                    if node.content is content:
                        node.content = copy
                        store.drop(content)
                    else:
                        store.drop(copy)         # replaced meanwhile
        return False

    async def create(self, parent_ino: int, name: bytes, mode: int, flags: int,
                     caller: Caller) -> tuple[int, Node, int]:
        """Create and open a file: (file handle, its node, the backing id as ``open``)."""
        parent = await self.dir(parent_ino)
        node = self.cache.create(parent, name, mode & ~caller.umask, caller.uid, self._gid(parent, caller))
        append = bool(flags & os.O_APPEND)
        # The creating handle always counts as a writer, so that the new file is
        # published at its last close even when it was opened read-only.
        backing_id = self._passthrough(node, True)
        self.cache.open(node, True, False, append, passthrough=bool(backing_id))
        fh = self._new_fh()
        self.handles[fh] = Handle(node, True, append, passthrough=bool(backing_id))
        return fh, node, backing_id

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self.handle(fh)
        node = h.node
        if node.staged is not None:
            data = await self.wt.read_staged(node, off, size)
            if data is not None:
                return data
        data = self.cache.read(node, off, size)
        if data is not None:
            self.cache.touch(node)
            return data
        if h.backing_fd < 0 or (h.backing_version != node.versions and node.nlink):
            await self._open_backing(h)
        return await trio.to_thread.run_sync(self.backing.read, h.backing_fd, size, off)

    async def _open_backing(self, h: Handle, verify: bool = False) -> None:
        """(Re)open the backing copy of the handle's file for reading; ``verify``: the very
        version the mount knows, else ESTALE (an open looks the name up again)."""
        node = h.node
        version = node.versions   # read before: a publish meanwhile only reopens once more
        fd = await trio.to_thread.run_sync(self.cache.open_backing_copy, node, verify)
        if h.backing_fd >= 0:
            self.backing.close_fd(h.backing_fd)
        h.backing_fd, h.backing_version = fd, version

    def write_now(self, fh: int, off: int, data: memoryview) -> int | None:
        """A WRITE straight from libfuse's buffer: bytes written, or None to take the async
        path (``write``). ``data`` is valid only during this call: it is copied into the cache."""
        h = self.handle(fh)
        self._clear_priv(h)
        # O_APPEND: at the end of the file as this mount has it, whatever offset the kernel
        # computed (from a size it may hold from before another node's longer version)
        return self.wt.write_now(h.node, h.node.size if h.append else off, data)

    def fallocate(self, fh: int, mode: int, off: int, length: int) -> int:
        """fallocate(2): mode 0 extends the file to off + length (the range reads as zeros;
        RAM is taken as it is written, so a later write can still wait for a full cache);
        FALLOC_FL_KEEP_SIZE changes nothing. Other modes (punching or zeroing holes,
        collapsing ranges) and files written through to the backing: EOPNOTSUPP, where
        glibc's posix_fallocate writes the range itself. Returns 0 or -errno."""
        h = self.handle(fh)
        if not h.writable:
            return -errno.EBADF
        if mode & ~FALLOC_FL_KEEP_SIZE:
            return -errno.EOPNOTSUPP
        if off < 0 or length <= 0:
            return -errno.EINVAL
        node, end = h.node, off + length
        self.cache.sync_content(node)
        if mode & FALLOC_FL_KEEP_SIZE or end <= node.size:
            return 0
        if node.content is None or not self.wt.in_cache(node) or self.cache.shared_in_kernel(node):
            return -errno.EOPNOTSUPP
        self._clear_priv(h)
        self.cache.truncate(node, end)
        return 0

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handle(fh)
        self._clear_priv(h)
        return await self.wt.write(h.node, h.node.size if h.append else off, buf)

    def _clear_priv(self, h: Handle) -> None:
        """Before a change of content through ``h``: clears setuid/setgid (``kill_priv``)
        if it was opened by a user other than root."""
        if h.kill_priv and h.node.mode & PRIV_BITS:
            self.kill_priv(h.node)

    def kill_priv(self, node: Node, chown: bool = False) -> None:
        """As the kernel does for a local filesystem: a write or truncate by a user other
        than root (who has CAP_FSETID), or any change of owner, clears setuid, and setgid
        where the group may execute (a setgid file without it is a locking mark, kept)."""
        mode = node.mode & ~statmod.S_ISUID
        if node.mode & statmod.S_IXGRP:
            mode &= ~statmod.S_ISGID
        if mode != node.mode:
            self.cache.setattr(node, mode=mode)
            if not chown:
                self.cache.kernel.forget_attrs(node.ino)   # the kernel asks for the new mode

    def flush(self, fh: int) -> None:
        """close(): what it acknowledges is journaled and stamped here.

        close() returns when FLUSH is answered; RELEASE, which queues the file, follows
        without being waited for. So the content close() acknowledges is journaled here
        (Cache.record_close) and stamped for global order (OpLog.note_ack). No waiting for
        a staged file being built: the cached content stays valid until it is complete, and the
        record holds them. A FLUSH whose RELEASE does not follow (the close of a copy of
        the descriptor in a forked process) is queued by ``_queue_late_acks``.
        """
        h = self.handles.get(fh)
        if h is None or not h.writable or h.node.writers != 1 or not h.node.dirty:
            return
        self.cache.sync_content(h.node)
        self.cache.record_close(h.node)
        self.cache.oplog.note_ack(h.node)

    async def _count_passthrough_writes(self) -> None:
        """What writers the kernel passes through have written is counted every
        PASSTHROUGH_LOOK seconds (``Cache.sync_content``), so that the cache's use in
        ``status`` and the admission of the next writers (``Cache.headroom``) are current;
        a cache pushed past its size by them is said once, in the log."""
        cache = self.cache
        over = False
        while True:
            await trio.sleep(PASSTHROUGH_LOOK)
            for node in list(cache.passthrough_writers):
                cache.sync_content(node)
            cache.trim()
            now_over = cache.store.used > cache.store.limit
            if now_over and not over:
                log.warning("cache over its size: %s held, %s allowed: files written with "
                            "passthrough grew past what was kept free for them (%d still open); "
                            "new writers take the daemon's path until enough is persisted",
                            format_size(cache.store.used), format_size(cache.store.limit),
                            len(cache.passthrough_writers))
            over = now_over

    async def _queue_late_acks(self) -> None:
        """Global order: content that a close() acknowledged is part of this node's
        frontier until it is queued. If its RELEASE does not come (a forked process closed
        its copy of the descriptor; the file stays open), the frontier would stay there, and
        hold the other nodes, until the file is closed for good: the content is queued
        after LATE_ACK seconds instead, as at a RELEASE."""
        while True:
            await trio.sleep(LATE_ACK / 2)
            peers, cache = self.peers, self.cache
            if peers is None or not cache.oplog.acked:
                continue
            with cache.oplog.lock:
                live = bool(peers.live())
                late = [ino for ino, (first, _) in cache.oplog.acked.items()
                        if time.time() - first > LATE_ACK]
            for ino in late if live else ():
                node = cache.nodes.get(ino)
                if node is None or not node.nlink or not node.dirty:
                    with cache.oplog.lock:          # gone, or queued meanwhile
                        cache.oplog.acked.pop(ino, None)
                    continue
                if self.wt.busy(node):        # being written through: queued when settled
                    continue
                log.info("%s: closed by one process, still open in another: queued now",
                         node_path(node))
                cache.snapshot(node)

    async def acknowledged(self) -> None:
        """Global order (peers.py), for a request that acknowledged a change: answered once
        (1) the node's record no longer promises that nothing is pending under the change's
        stamp (``Peers.announce``; or that promise has run out), and (2) while other nodes
        are live, this node's clock is the tolerated skew past the stamp (commit wait), so
        that whatever another node does after the answer is stamped later, even by a clock
        that is behind."""
        peers = self.peers
        if peers is None:
            return
        with self.cache.oplog.lock:
            stamp = self.cache.oplog.last_stamp
            until = peers.commit_until(stamp)
            promised = peers.promised
        if promised > stamp:
            # bounded by the promise itself: a backing that hangs costs at most that long
            with trio.move_on_at(trio.current_time() + promised + peers.skew - time.time()):
                await trio.to_thread.run_sync(peers.announce, abandon_on_cancel=True)
                promised = 0.0
            if promised:
                until = max(until, promised + peers.skew + UNIT)
        delay = until - time.time()
        if delay > 0:
            await trio.sleep(delay)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            raise err(errno.EBADF, f"file handle {fh} is not open")
        if h.writable:
            await self.wt.settle(h.node)
        node = h.node
        self.cache.sync_content(node)
        if h.passthrough and h.writable and node.writers == 1 and not node.dirty and node.nlink \
                and node.last_seq > h.opened_seq:
            # queued while open (a close() whose RELEASE did not follow: a mapping or a forked
            # process kept the file): what they wrote since never came here
            self.cache.note_change(node)
        try:
            self.cache.release(node, h.writable, h.append and h.writable, h.passthrough)
        finally:
            if h.backing_fd >= 0:
                self.backing.close_fd(h.backing_fd)
        if h.writable and not node.writers and node.open_copy is not None:
            await self.wt.closed(node)

    async def fsync(self, fh: int) -> None:
        if self.info.fsync_backing:
            await self.wt.fsync(self.handle(fh).node)

    async def preload(self, node: Node) -> bytes:
        """``user.acpfs.preload``: read a file's backing copy into the cache, for a fast resume.

        Never waits for the flusher: when the cache cannot hold the file even after evicting
        persisted files, the answer is ENOSPC at once. A preloaded file is clean and
        evictable like any persisted file.
        """
        cache = self.cache
        if not node.is_reg:
            raise err(errno.EINVAL, "only regular files can be preloaded")
        await self.wt.settle(node)
        if node.content is None and node.staged is None:
            if node.size > cache.store.limit:
                raise err(errno.EFBIG, "file larger than the cache")
            async with self.wt.copying(node):
                if node.content is None:
                    try:
                        content = cache.copy_up(node)
                    except CacheFull:
                        raise err(errno.ENOSPC, "cache full") from None
                    try:
                        await trio.to_thread.run_sync(cache.read_backing_into, node, content)
                    except BaseException:
                        cache.release_content(content)
                        raise
                    cache.attach_content(node, content)
                    cache.maybe_evictable(node)
        cache.touch(node)
        return json.dumps({"size": node.size, "cached": node.content is not None}).encode()

    # -- the backing's numbers -------------------------------------------------------------
    async def statfs(self) -> os.statvfs_result:
        """The backing's numbers, asked at most once at a time and waited for at most
        STATFS_WAIT seconds: on a hung backing the last answer is given (statvfs is how
        'acpfs status' tells a live mount from a stale one, so it must not hang)."""
        if self._statfs_call is None:
            self._statfs_call = trio.Event()
            self.background.start_soon(self._refresh_statfs, self._statfs_call)
        with trio.move_on_after(STATFS_WAIT):
            await self._statfs_call.wait()
        if self._statfs is None:
            raise err(errno.EIO, "the backing directory is not answering")
        return self._statfs

    async def _refresh_statfs(self, done: trio.Event) -> None:
        try:
            self._statfs = await trio.to_thread.run_sync(self.backing.statvfs, abandon_on_cancel=True)
        except OSError as e:
            log.warning("statvfs of the backing failed: %s", e)
        finally:
            self._statfs_call = None
            done.set()

    # -- extended attributes ---------------------------------------------------------------
    async def getxattr(self, ino: int, name: bytes, uid: int = 0) -> bytes:
        node = self.node(ino)
        if name == control.PRELOAD:
            return await self.preload(node)
        if name.startswith(control.PREFIX):
            # file names are for root and the mount's owner (with --allow-other, other users
            # could otherwise read names inside directories they may not list)
            return control.get(self.flusher, self.info, node, name,
                               trusted=uid in (0, self.info.owner))
        if not name.startswith(b"user."):
            raise err(errno.ENODATA)
        value = (await self.xattrs_loaded(node)).get(name)
        if value is None:
            raise err(errno.ENODATA)
        return value

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        node = self.node(ino)
        if name.startswith(control.PREFIX):
            raise err(errno.EPERM, "acpfs control attributes are read-only")
        if not name.startswith(b"user.") or node.is_link:
            raise err(errno.ENOTSUP, "only user extended attributes are supported")
        await self.xattrs_loaded(node)
        self.cache.set_xattr(node, name, value)

    async def listxattr(self, ino: int) -> list[bytes]:
        return list(await self.xattrs_loaded(self.node(ino)))

    async def removexattr(self, ino: int, name: bytes) -> None:
        node = self.node(ino)
        if name.startswith(control.PREFIX):
            raise err(errno.EPERM, "acpfs control attributes are read-only")
        await self.xattrs_loaded(node)
        self.cache.set_xattr(node, name, None)   # ENODATA if it is not set
