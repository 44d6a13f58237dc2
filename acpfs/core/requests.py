"""The filesystem's operations under trio, without FUSE: what each request does.

``fs`` turns a FUSE request into one call here (or on ``Core.handles``) and the result into
a reply; tests call these methods directly (tests/unit/test_core.py), with the real cache,
flusher and a backing that can fail or hang. ``Core`` builds, in order, and holds the parts
that own the request-side state:

- ``loader`` (``loader.Loader``): loading directories and extended attributes from the
  backing and revalidating what it knows, in worker threads, so that a slow or hung
  backing never stalls the trio loop;
- ``wt`` (``writethrough.WriteThrough``) and ``longopen`` (``longopen.LongOpen``): a file's
  content while the cache is full, and files open for writing for a long time;
- ``handles`` (``handles.Handles``): open file and directory handles and the requests on
  them (open, read, write, flush, release, fsync, preload).

``Core`` itself answers the requests on names (lookup, mkdir, unlink, rename, setattr,
...), the extended attributes and control attributes (``control``), statfs (owning the
last answer and the call in flight), and content acknowledged by a close whose RELEASE does
not come (``_queue_late_acks``; the waits of global order are ``order``'s, globalorder.py).
The namespace and cached content are ``cache``'s.

Errors are ``node.FsError`` (an errno); anything else raised here is a bug.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as statmod
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

import trio

from . import control
from .handles import PRIV_BITS, Handles, Kernel
from .loader import Loader
from .longopen import LongOpen
from .opennow import OpensNow
from .peerreads import PeerPlane, PeerReads
from .peerserve import PeerServing
from .unshare import unshared
from ..node import Node, err, node_path
from .writethrough import Background, WriteThrough

if TYPE_CHECKING:
    from ..flusher.flusher import Flusher
    from ..cluster.globalorder import GlobalOrder

log = logging.getLogger(__name__)

STATFS_WAIT = 2.0  # seconds statfs waits for the backing before answering from memory
NAME_MAX = 255   # bytes in one name, as every filesystem the backing may be on
LATE_ACK = 0.5   # s: content acknowledged by a close() whose RELEASE has not come is queued


class Caller(Protocol):
    """Who made a request (pyfuse3's RequestContext has these)."""
    uid: int
    gid: int
    umask: int




class Core:
    def __init__(self, flusher: Flusher, info: control.MountInfo, *,
                 order: GlobalOrder | None = None, kernel: Kernel | None = None,
                 direct_io_mmap: Callable[[], bool] = lambda: False,
                 invalidate_attrs: Callable[[int], None] = lambda ino: None,
                 peer_plane: PeerPlane | None = None) -> None:
        self.flusher = flusher   # status and the control attributes
        self.cache = cache = flusher.cache
        self.oplog = cache.oplog
        self.inodes, self.files, self.names = cache.inodes, cache.files, cache.names
        self.order = order     # global order (globalorder.py); None: off
        # --replica-wait: close() waits for another node's copy (cluster/replicate.py)
        self.replica_wait: Callable[[], Awaitable[None]] | None = None
        self.kernel = kernel   # passthrough (passthrough.py); None: every request comes here
        self.backing = cache.backing
        self.info = info
        self.background = Background()
        opts = self.opts = info.opts
        self.loader = Loader(cache.inodes, cache.coherence, cache.backing, opts, cache.kernel,
                             invalidate_attrs)
        self.wt = WriteThrough(cache.files, self.background, opts.cache_full_timeout,
                               flusher.give_way.waited_for)
        self.longopen = LongOpen(cache.files, self.wt, self.background, opts.persist_open_after)
        self.handles = Handles(cache.inodes, cache.files, cache.names, self.loader, self.wt,
                               self.longopen, opts, kernel=kernel, direct_io_mmap=direct_io_mmap,
                               admission=cache.admission)
        fetch = self.handles.fetch
        info.cold_reads = lambda: {**self.handles.cold.status(), **fetch.status()}
        info.backing_calls = self.loader.calls.status
        # files read from other nodes' RAM, and served to them (--peers-listen)
        self.peer_reads = PeerReads(cache.files, cache.inodes, self.wt, peer_plane,
                                    PeerServing(cache.files, cache.inodes, self.handles.fetch,
                                                self.find)) \
            if peer_plane is not None else None
        self.handles.peer_reads = self.peer_reads
        if self.peer_reads is not None:
            info.peer_plane = self.peer_reads.status
        self.opens_now = OpensNow(self.handles)   # read-only OPENs answered without a coroutine
        self._statfs: os.statvfs_result | None = self.backing.statvfs()   # answers at mount
        self._statfs_call: trio.Event | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Background work: write-through in a full cache, files open for a long time,
        acknowledged content whose RELEASE does not come, what writers passed through wrote,
        answers the kernel keeps until a change lands (fuse/notices.py)."""
        nursery.start_soon(self.background.run, nursery)
        nursery.start_soon(self.longopen.run)
        nursery.start_soon(self._queue_late_acks)
        nursery.start_soon(self.cache.kernel.run, self.cache.coherence.quiescent)
        self.handles.start(nursery)
        if self.peer_reads is not None:
            self.peer_reads.start(nursery)

    # -- resolving ids ---------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        return self.inodes.known(ino)

    async def dir(self, ino: int) -> Node:
        return await self.loader.loaded(self.node(ino))

    async def getattr(self, ino: int) -> Node:
        node = await self.loader.revalidated(self.node(ino))
        self.files.sync_content(node)
        return node

    # -- the namespace ---------------------------------------------------------------------
    async def lookup(self, parent_ino: int, name: bytes) -> Node:
        node = await self.find(parent_ino, name)
        if node is None:
            raise err(errno.ENOENT)
        return node

    async def find(self, parent_ino: int, name: bytes) -> Node | None:
        """The node of ``name`` in directory ``parent_ino``, or None when the name is missing
        for sure, from this mount's view and from the backing (an answer the kernel may keep
        for the coherence timeout: docs/semantics.md, section 10). ENOENT (raised) where
        that is not known: the backing failed or did not answer in time."""
        node = await self._lookup(parent_ino, name)
        if node is not None:
            self.files.sync_content(node)   # the reply's size must not undo a write passed through
        return node

    async def _lookup(self, parent_ino: int, name: bytes) -> Node | None:
        if len(name) > NAME_MAX:
            raise err(errno.ENAMETOOLONG, "name longer than 255 bytes")
        # Another node may have made, removed or replaced the name since this directory was
        # last listed: the name alone is compared with the backing (one lstat, as NFS's
        # LOOKUP), never the whole directory (that is opendir's, Loader.refreshed).
        began = time.monotonic()
        parent = await self.dir(parent_ino)
        # a listing that read the directory, begun during this lookup (the directory's
        # first), looked at the name already: a name missing from it is missing, and its
        # lstat checked a clean file. Not an opendir that found the directory's version
        # unchanged meanwhile (Loader.refreshed): that version may be an attribute cache's
        # (NFS), older than a name another node made since the listing before
        listed = parent.read_at >= began
        node = parent.entries().get(name)
        if node is None:
            if listed:
                return None
            return await self.loader.found_elsewhere(parent, name)
        if listed and self._as_listed(parent, name, node):
            return node
        # The kernel asks only once its entry ran out, or to be sure (before a create, link,
        # mkdir or rename onto the name: LOOKUP_EXCL, LOOKUP_RENAME_TARGET): a clean file is
        # compared with the backing now, as at an open, so that a name another node removed
        # or replaced is not answered from this node's view (EEXIST for a name that is
        # gone). The reply carries the attributes, which the kernel then keeps.
        try:
            if node.is_reg:
                await self.loader.revalidated(node, at_open=True, forget=False)
            else:
                await self.loader.entry_checked(parent, name, node)
        except OSError as e:
            if e.errno != errno.ESTALE:
                raise
        node = parent.entries().get(name)   # what the check left there
        if node is None:   # the name left the view: what the backing holds there now, if any
            return await self.loader.found_elsewhere(parent, name)
        return node

    def find_now(self, parent_ino: int, name: bytes) -> tuple[bool, Node | None]:
        """``find`` where it needs no coroutine (a LOOKUP answered at once, from the
        extension's hook: ``AtOnce.lookup``, fuse/atonce.py): (True, what ``find`` would return), or
        (False, None) where ``find`` must take the request: the directory cannot be listed at
        once, the name holds a file with several names, or a comparison with the backing
        cannot be made at once or finds a change (``find`` then applies it)."""
        if len(name) > NAME_MAX:
            raise err(errno.ENAMETOOLONG, "name longer than 255 bytes")
        began = time.monotonic()
        parent = self._loaded_now(parent_ino)
        if parent is None:
            return False, None
        listed = parent.read_at >= began   # as _lookup: read just now, here
        node = parent.entries().get(name)
        if node is None:
            return (True, None) if listed else self.loader.found_elsewhere_now(parent, name)
        # as _lookup: a clean file is compared with the backing now, as at an open; any
        # other entry, its kind
        if not node.is_reg:
            if not self.loader.entry_unchanged_now(parent, name, node):
                return False, None
        elif not (listed and self._as_listed(parent, name, node)) and not self.loader.unchanged_now(node):
            return False, None
        self.files.sync_content(node)
        return True, node

    def _as_listed(self, parent: Node, name: bytes, node: Node) -> bool:
        """A file found under ``name`` by a listing of ``parent`` begun during this lookup
        is the backing's version as it is (no comparison needed): a clean regular file with
        one name, there."""
        return node.is_reg and not node.links and self.loader.coherence.quiescent(node) \
            and node.position_at(parent, name) is not None

    @staticmethod
    def _gid(parent: Node, caller: Caller) -> int:
        return parent.gid if parent.mode & statmod.S_ISGID else caller.gid

    async def mkdir(self, parent_ino: int, name: bytes, mode: int, caller: Caller) -> Node:
        parent = await self.dir(parent_ino)
        mode &= ~caller.umask
        if parent.mode & statmod.S_ISGID:
            mode |= statmod.S_ISGID   # inherited, as on a local filesystem
        return self.names.mkdir(parent, name, mode, caller.uid, self._gid(parent, caller))

    async def symlink(self, parent_ino: int, name: bytes, target: bytes, caller: Caller) -> Node:
        parent = await self.dir(parent_ino)
        return self.names.symlink(parent, name, target, caller.uid, self._gid(parent, caller))

    async def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, caller: Caller) -> Node:
        """mknod(2): a regular file (empty, queued at once), a FIFO, a socket, or a device
        node (the kernel lets only callers with CAP_MKNOD ask; the daemon makes it in the
        backing, so it must be root too)."""
        parent = await self.dir(parent_ino)
        kind = statmod.S_IFMT(mode) or statmod.S_IFREG
        perm = statmod.S_IMODE(mode) & ~caller.umask
        gid = self._gid(parent, caller)
        if kind == statmod.S_IFREG:
            node = self.names.create(parent, name, perm, caller.uid, gid)
            self.files.snapshot(node)
            return node
        if kind in (statmod.S_IFCHR, statmod.S_IFBLK) and os.geteuid() != 0:
            raise err(errno.EPERM, "device nodes need an acpfs daemon running as root")
        if kind not in (statmod.S_IFCHR, statmod.S_IFBLK, statmod.S_IFIFO, statmod.S_IFSOCK):
            raise err(errno.EINVAL)
        return self.names.mknod(parent, name, kind | perm, rdev, caller.uid, gid)

    async def link(self, ino: int, parent_ino: int, name: bytes) -> Node:
        """link(2): one more name for a file (the kernel refuses directories and checks the
        caller's permissions; protected_hardlinks is the kernel's too)."""
        node = self.node(ino)
        self.names.link(node, await self.dir(parent_ino), name)
        return node

    async def unlink(self, parent_ino: int, name: bytes) -> None:
        """unlink(2). The kernel sends it for a name it may know from before another node's
        change (within its entry timeout): a clean file is compared with the backing first,
        as a lookup would, so that the name is removed whichever version it holds now (as
        an NFS server removes the name), never kept as 'newer than this node's'."""
        parent = await self.dir(parent_ino)
        node = parent.entries().get(name)
        if node is not None and node.is_reg:
            try:
                await self.loader.revalidated(node, at_open=True, forget=False)
            except OSError as e:
                if e.errno != errno.ESTALE:
                    raise
        self.names.unlink(parent, name)

    def unlinkable_now(self, parent_ino: int, name: bytes) -> Node | None:
        """For an UNLINK answered at once (fuse/atonce.py): the directory, where ``unlink``
        needs no coroutine: its entries are loaded, and a regular file's comparison with the
        backing can be made at once and finds the version this mount has
        (``Loader.unchanged_now``); None where ``unlink`` must take the request. The name is
        then removed with ``unlink_in``, under ``OpLog.lock`` (no backing call there)."""
        parent = self._loaded_now(parent_ino)
        if parent is None:
            return None
        node = parent.entries().get(name)
        if node is not None and node.is_reg and not self.loader.unchanged_now(node):
            return None
        return parent

    def _loaded_now(self, ino: int) -> Node | None:
        """The directory ``ino`` where its entries are loaded, or can be at once
        (``Loader.loaded_now``: a request answered at once cannot wait for ``dir``), else
        None."""
        parent = self.node(ino)
        return parent if self.loader.loaded_now(parent) else None

    def unlink_in(self, parent: Node, name: bytes) -> None:
        self.names.unlink(parent, name)

    async def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = await self.dir(parent_ino)
        await self.loader.loaded(self.names.lookup(parent, name))
        self.names.rmdir(parent, name)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     noreplace: bool) -> None:
        p1 = await self.dir(old_parent)
        p2 = await self.dir(new_parent)
        target = p2.entries().get(new_name)
        if target is not None and target.is_dir:
            await self.loader.loaded(target)
        self.names.rename(p1, old_name, p2, new_name, noreplace=noreplace)

    def readlink(self, ino: int) -> bytes:
        node = self.node(ino)
        if not node.is_link:
            raise err(errno.EINVAL, "not a symlink")
        return node.target

    def forget(self, ino: int, n: int) -> None:
        inodes = self.inodes
        node = inodes.nodes.get(ino)
        if node is not None and node is not inodes.root:
            inodes.forget(node, n, ino)

    async def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None, atime: int | None = None,
                      mtime: int | None = None, caller_uid: int = 0) -> Node:
        node = self.node(ino)
        if size is not None:
            if not node.is_reg:
                raise err(errno.EINVAL, "not a regular file")
            await self.loader.xattrs_loaded(node)
            self.files.sync_content(node)
            while not await unshared(self.files, self.wt, node, size == 0):
                pass
            await self.wt.truncate(node, size)
        if (mode, uid, gid, atime, mtime) != (None,) * 5:
            self.names.setattr(node, mode=mode, uid=uid, gid=gid, atime=atime, mtime=mtime)
        # with FUSE_HANDLE_KILLPRIV_V2 the kernel leaves this to us: a truncate by a user
        # other than root, and a change of owner of anything but a directory (a fifo or a
        # device too, as chown(2) on Linux)
        if mode is None and not node.is_dir and node.mode & PRIV_BITS and (
                (size is not None and caller_uid != 0) or uid is not None or gid is not None):
            self.names.kill_priv(node, chown=True)     # the reply carries the new mode
        return node

    async def fsyncdir(self) -> None:
        if self.opts.fsync_backing:
            await self.wt.wait_seq(self.oplog.seq)

    async def create(self, parent_ino: int, name: bytes, mode: int, flags: int,
                     caller: Caller) -> tuple[int, Node, int]:
        """Create and open a file: (file handle, its node, the backing id as ``open``)."""
        return self._create_in(await self.dir(parent_ino), name, mode, flags, caller)

    def create_now(self, parent_ino: int, name: bytes, mode: int, flags: int,
                   caller: Caller) -> tuple[int, Node, int] | None:
        """``create`` where it needs no coroutine (a CREATE answered at once: fuse/atonce.py):
        the directory's entries are loaded; None where they are not."""
        parent = self._loaded_now(parent_ino)
        if parent is None:
            return None
        return self._create_in(parent, name, mode, flags, caller)

    def _create_in(self, parent: Node, name: bytes, mode: int, flags: int,
                   caller: Caller) -> tuple[int, Node, int]:
        node = self.names.create(parent, name, mode & ~caller.umask, caller.uid, self._gid(parent, caller))
        fh, backing_id = self.handles.open_created(node, flags)
        return fh, node, backing_id

    async def _queue_late_acks(self) -> None:
        """Global order: content that a close() acknowledged is part of this node's
        frontier until it is queued. If its RELEASE does not come (a forked process closed
        its copy of the descriptor; the file stays open), the frontier would stay there, and
        hold the other nodes, until the file is closed for good: the content is queued
        after LATE_ACK seconds instead, as at a RELEASE."""
        while True:
            await trio.sleep(LATE_ACK / 2)
            order, oplog = self.order, self.oplog
            if order is None or not oplog.acked:
                continue
            with oplog.lock:
                live = bool(order.peers.live())
                late = [ino for ino, (first, _) in oplog.acked.items()
                        if time.time() - first > LATE_ACK]
            for ino in late if live else ():
                node = self.inodes.nodes.get(ino)
                if node is None or not node.nlink or not node.dirty:
                    with oplog.lock:          # gone, or queued meanwhile
                        oplog.acked.pop(ino, None)
                    continue
                if self.wt.busy(node):        # being written through: queued when settled
                    continue
                log.info("%s: closed by one process, still open in another: queued now",
                         node_path(node))
                self.files.snapshot(node)

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
            return await self.handles.fetch.preload(node)
        if name.startswith(control.PREFIX):
            # file names are for root and the mount's owner (with --allow-other, other users
            # could otherwise read names inside directories they may not list)
            return control.get(self.flusher, self.info, node, name,
                               trusted=uid in (0, self.info.owner), wt=self.wt)
        if not name.startswith(b"user."):
            raise err(errno.ENODATA)
        value = (await self.loader.xattrs_loaded(node)).get(name)
        if value is None:
            raise err(errno.ENODATA)
        return value

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        node = self.node(ino)
        if name.startswith(control.PREFIX):
            raise err(errno.EPERM, "acpfs control attributes are read-only")
        if not name.startswith(b"user.") or node.is_link:
            raise err(errno.ENOTSUP, "only user extended attributes are supported")
        await self.loader.xattrs_loaded(node)
        self.names.set_xattr(node, name, value)

    async def listxattr(self, ino: int) -> list[bytes]:
        return list(await self.loader.xattrs_loaded(self.node(ino)))

    async def removexattr(self, ino: int, name: bytes) -> None:
        node = self.node(ino)
        if name.startswith(control.PREFIX):
            raise err(errno.EPERM, "acpfs control attributes are read-only")
        await self.loader.xattrs_loaded(node)
        self.names.set_xattr(node, name, None)   # ENODATA if it is not set
