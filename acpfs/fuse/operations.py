"""The FUSE adapter: pyfuse3 requests in, ``Core`` calls out, replies back.

Each handler resolves what the kernel sends (inode numbers, file handles, request fields),
makes one call into ``core.requests.Core`` (requests on file and directory handles: into
``Core.handles``), and builds the reply. It keeps the kernel's lookup counts
(``Node.lookups``) and turns errors into FUSE errors in one place (``errno_of``). All
semantics live in ``core`` and the parts it holds, ``cache`` and ``flusher``.

Per-request cost matters (about 30 us of Python per request): ``write``, ``write_now`` and
``read`` do no logging and no allocation beyond what pyfuse3 hands over.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import queue
import threading
import time
from typing import Any, Callable

import trio

from . import fastwrite  # (before pyfuse3: it interposes fuse_session_new and _mount)

import pyfuse3  # noqa: E402

from ..core.requests import Core  # noqa: E402
from ..cache.inodes import Inodes  # noqa: E402
from ..node import KernelNotices, Node  # noqa: E402

log = logging.getLogger(__name__)

ATTR_TIMEOUT = 5.0
# How long the kernel may answer from its own caches of names and attributes: ATTR_TIMEOUT,
# or less where coherence checks look more often (make_operations). A stat or lookup that the
# kernel answers itself never reaches Loader.revalidated/refreshed.
kernel_timeout = ATTR_TIMEOUT
# names the kernel was told are missing, kept to drop its answer when another node makes one
MISSING_PRUNE_AT = 100_000
SETTLE_WAIT = 0.5   # an opendir waits at most this long for the kernel to drop such answers
BLKSIZE = 1 << 20  # what stat reports: programs size their buffers by it
STATVFS_FIELDS = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                  "f_favail", "f_namemax")


def errno_of(exc: BaseException, where: str) -> int:
    """The one error mapping: the errno of an OSError (FsError, or one from the backing);
    anything else is a bug, logged with its traceback, and answered EIO."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, OSError):
        return exc.errno or errno.EIO
    log.error("internal error in %s", where, exc_info=exc)
    return errno.EIO


def replies(fn: Callable) -> Callable:
    """A handler whose errors become FUSE errors (``errno_of``)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        if args and isinstance(args[0], Operations):   # a handler (tests wrap functions too)
            args[0].core.info.requests[name] += 1
        try:
            return await fn(*args)
        except Exception as e:
            raise pyfuse3.FUSEError(errno_of(e, fn.__name__)) from None
    return wrapper


def acknowledges(fn: Callable) -> Callable:
    """A handler whose request may acknowledge a change (one stamped meanwhile: OpLog.next_stamp):
    answered after the commit wait of global order (GlobalOrder.acknowledged)."""
    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        before = self.core.oplog.last_stamp
        out = await fn(self, *args)
        order = self.core.order
        if order is not None and self.core.oplog.last_stamp != before:
            await order.acknowledged()
        return out
    return wrapper


def dir_links(node: Node) -> int:
    """A directory's link count, as on a local filesystem: 2 and one per subdirectory (its
    ".."); 2 while its entries are not loaded (find and ls only use it as a hint then)."""
    if not node.nlink:
        return 0
    return 2 + (node.children.dirs if node.children is not None else 0)


def attrs(node: Node) -> pyfuse3.EntryAttributes:
    """A node's attributes, its inode number as st_ino (a GETATTR reply)."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = node.ino
    a.entry_timeout = kernel_timeout
    a.attr_timeout = kernel_timeout
    a.st_mode = node.mode
    a.st_nlink = node.nlink if not node.is_dir else dir_links(node)
    a.st_uid = node.uid
    a.st_gid = node.gid
    a.st_size = node.size
    a.st_rdev = node.rdev
    a.st_blksize = BLKSIZE
    a.st_blocks = (node.size + 511) // 512
    a.st_atime_ns = node.atime
    a.st_mtime_ns = node.mtime
    a.st_ctime_ns = node.ctime
    return a


def missing() -> pyfuse3.EntryAttributes:
    """A LOOKUP's answer for a name that is missing for sure (``Core.find``): a negative
    entry, which the kernel keeps for the coherence timeout and answers ENOENT from itself
    meanwhile (as NFS's lookupcache=all: a program that probes a missing name over and over,
    as SQLite its journal, costs no request)."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = 0
    a.entry_timeout = kernel_timeout
    return a


def entry(inodes: Inodes, node: Node) -> pyfuse3.EntryAttributes:
    """Attributes of a node the kernel will hold a reference to (one lookup more), under
    the node id new lookups of it get (``Inodes.looked_up``): pyfuse3 sends st_ino as the
    node id, and the C extension shows the node's own inode number in its place."""
    a = attrs(node)
    a.st_ino = inodes.looked_up(node)
    return a


def pass_through(core: Core, backing_id: int) -> None:
    """The last step of an OPEN or CREATE handler: pyfuse3 sends the reply as soon as the
    handler returns, with no other request handled in between, and the C extension adds
    ``backing_id`` to it (FOPEN_PASSTHROUGH). Nothing may fail after this call."""
    if backing_id:
        assert core.kernel is not None
        core.kernel.reply(backing_id)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, core: Core) -> None:
        super().__init__()
        self.core = core
        self.handles = core.handles   # open files and directories

    # -- namespace -------------------------------------------------------------------------
    @replies
    async def lookup(self, parent_inode, name, ctx=None):
        notices = self.core.cache.kernel
        notices.looking(parent_inode, name)
        node = await self.core.find(parent_inode, name)
        if node is None:
            notices.missing(parent_inode, name)
            return missing()
        return entry(self.core.inodes, node)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            self.core.forget(ino, n)

    @replies
    async def getattr(self, inode, ctx=None):
        return attrs(await self.core.getattr(inode))

    @replies
    @acknowledges
    async def setattr(self, inode, attr, fields, fh, ctx):
        return attrs(await self.core.setattr(
            inode,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime=attr.st_atime_ns if fields.update_atime else None,
            mtime=attr.st_mtime_ns if fields.update_mtime else None,
            caller_uid=ctx.uid))

    @replies
    async def readlink(self, inode, ctx):
        return self.core.readlink(inode)

    @replies
    @acknowledges
    async def mkdir(self, parent_inode, name, mode, ctx):
        return entry(self.core.inodes, await self.core.mkdir(parent_inode, name, mode, ctx))

    @replies
    @acknowledges
    async def unlink(self, parent_inode, name, ctx):
        await self.core.unlink(parent_inode, name)

    @replies
    @acknowledges
    async def rmdir(self, parent_inode, name, ctx):
        await self.core.rmdir(parent_inode, name)

    @replies
    @acknowledges
    async def symlink(self, parent_inode, name, target, ctx):
        return entry(self.core.inodes, await self.core.symlink(parent_inode, name, target, ctx))

    @replies
    @acknowledges
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        await self.core.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                               noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE))

    @replies
    @acknowledges
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return entry(self.core.inodes, await self.core.link(inode, new_parent_inode, new_name))

    @replies
    @acknowledges
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return entry(self.core.inodes, await self.core.mknod(parent_inode, name, mode, rdev, ctx))

    # -- directories -----------------------------------------------------------------------
    @replies
    async def opendir(self, inode, ctx):
        fh = await self.handles.opendir(inode)
        await self.core.cache.kernel.settled()
        return fh

    @replies
    async def readdir(self, fh, start_id, token):
        entries = self.handles.dir_entries(fh)
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            self.core.files.sync_content(node)
            a = attrs(node)
            a.st_ino = node.nodeid
            if not pyfuse3.readdir_reply(token, name, a, i + 1):
                break
            self.core.inodes.looked_up(node)

    async def releasedir(self, fh):
        self.handles.releasedir(fh)

    @replies
    async def fsyncdir(self, fh, datasync):
        await self.core.fsyncdir()

    # -- files -----------------------------------------------------------------------------
    @replies
    async def open(self, inode, flags, ctx):
        fh, direct, backing_id = await self.handles.open(inode, flags, ctx.uid)
        info = pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=False)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            # a reader's close has nothing to stamp (Handles.flush) and no lock of the
            # daemon's to drop (POSIX locks are the kernel's): no FLUSH round trip
            fastwrite.reply_noflush()
        pass_through(self.core, backing_id)
        return info

    @replies
    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, node, backing_id = await self.core.create(parent_inode, name, mode, flags, ctx)
        info = pyfuse3.FileInfo(fh=fh, direct_io=self.handles.direct_io_mmap() and not backing_id,
                                keep_cache=False)
        reply = info, entry(self.core.inodes, node)
        pass_through(self.core, backing_id)
        return reply

    async def read(self, fh, off, size):
        self.core.info.requests["read"] += 1
        try:
            return await self.handles.read(fh, off, size)
        except Exception as e:
            raise pyfuse3.FUSEError(errno_of(e, "read")) from None

    def write_now(self, fh: int, off: int, data: memoryview) -> int | None:
        """WRITE straight from libfuse's buffer (acpfs/fuse/_fastwrite.c): bytes written, -errno,
        or None to take the async path (``write``)."""
        self.core.info.requests["write"] += 1
        try:
            return self.handles.write_now(fh, off, data)
        except Exception as e:
            return -errno_of(e, "write")

    def fallocate_now(self, fh: int, mode: int, off: int, length: int) -> int:
        """FALLOCATE (acpfs/fuse/_fastwrite.c; pyfuse3 has no handler): 0 or -errno."""
        try:
            return self.handles.fallocate(fh, mode, off, length)
        except Exception as e:
            return -errno_of(e, "fallocate")

    async def write(self, fh, off, buf):
        try:
            return await self.handles.write(fh, off, buf)
        except Exception as e:
            raise pyfuse3.FUSEError(errno_of(e, "write")) from None

    @replies
    @acknowledges
    async def flush(self, fh):
        self.handles.flush(fh)   # close(): stamps what it acknowledges (Handles.flush)

    @replies
    async def release(self, fh):
        await self.handles.release(fh)

    @replies
    async def fsync(self, fh, datasync):
        await self.handles.fsync(fh)

    @replies
    async def statfs(self, ctx):
        st = await self.core.statfs()
        out = pyfuse3.StatvfsData()
        for key in STATVFS_FIELDS:
            setattr(out, key, getattr(st, key))
        return out

    # -- extended attributes ---------------------------------------------------------------
    @replies
    async def getxattr(self, inode, name, ctx):
        return await self.core.getxattr(inode, name, ctx.uid)

    @replies
    @acknowledges
    async def setxattr(self, inode, name, value, ctx):
        await self.core.setxattr(inode, name, value)

    @replies
    async def listxattr(self, inode, ctx):
        return await self.core.listxattr(inode)

    @replies
    @acknowledges
    async def removexattr(self, inode, name, ctx):
        await self.core.removexattr(inode, name)


class KernelCacheNotices(KernelNotices):
    """What the cache tells the kernel of changes another node made (``Cache.kernel``):
    pyfuse3's notifications. Owns the names the kernel was told are missing
    (``_missing``: (directory node id, name) -> until when the kernel may keep that answer),
    so that one another node makes is dropped from the kernel's cache as soon as this node
    sees it (``appeared``), and the invalidations in flight (``_queued``, ``_sent``)."""

    def __init__(self) -> None:
        self._forgets: queue.SimpleQueue[int | tuple[int, bytes]] = queue.SimpleQueue()
        self._missing: dict[tuple[int, bytes], float] = {}
        self._queued = 0   # entry invalidations queued (trio thread)
        self._sent = 0     # of those, sent (the notification thread)
        threading.Thread(target=self._send_forgets, name="acpfs-forget", daemon=True).start()

    def forget_entry(self, parent_ino: int, name: bytes) -> None:
        """A name another node removed leaves the kernel's dentry cache at once, not after
        ATTR_TIMEOUT (Coherence.merge_listing)."""
        pyfuse3.invalidate_entry_async(parent_ino, name, ignore_enoent=True)

    def looking(self, parent_ino: int, name: bytes) -> None:
        """A LOOKUP of the name came: the kernel holds no answer for it to drop."""
        self._missing.pop((parent_ino, name), None)

    def missing(self, parent_ino: int, name: bytes) -> None:
        """The kernel was told the name is missing (a negative entry, ``missing()``)."""
        now = time.monotonic()
        if len(self._missing) >= MISSING_PRUNE_AT:
            self._missing = {k: t for k, t in self._missing.items() if t > now}
            if len(self._missing) >= MISSING_PRUNE_AT:   # all live: drop the oldest half
                keep = sorted(self._missing.items(), key=lambda kv: kv[1])[len(self._missing) // 2:]
                self._missing = dict(keep)
        self._missing[(parent_ino, name)] = now + kernel_timeout

    def appeared(self, parent_ino: int, name: bytes) -> None:
        """Another node's name joined the view: a negative entry of it the kernel may still
        keep is invalidated (in the notification thread: the kernel may wait there for
        the directory's lock, which a request this thread answers can hold). A name whose
        record was dropped to keep the table bounded is seen once its entry runs out."""
        until = self._missing.pop((parent_ino, name), None)
        if until is not None and until > time.monotonic():
            self._queued += 1
            self._forgets.put((parent_ino, name))

    async def settled(self) -> None:
        """Returns once the invalidations queued so far were sent (at most
        ``SETTLE_WAIT`` seconds): an opendir answers after them, so that a name its
        listing shows is not answered missing by the kernel right after."""
        target = self._queued
        deadline = time.monotonic() + SETTLE_WAIT
        while self._sent < target and time.monotonic() < deadline:
            await trio.sleep(0.0005)

    def forget_attrs(self, node: Node) -> None:
        """Another node's version of a file: the kernel asks for its size again before it
        reads (Coherence.replaced_elsewhere); attributes only, which takes no lock a request may
        hold. Sent from a thread of its own, never from a request handler (a notification
        may wait on an inode the kernel is evicting, and the eviction on a request only this
        thread would answer)."""
        for nodeid in [node.ino, *(node.kernel_ids or ())]:   # Inodes.kernel_ids
            self._forgets.put(nodeid)

    def _send_forgets(self) -> None:
        while True:
            what = self._forgets.get()
            try:
                if isinstance(what, tuple):
                    pyfuse3.invalidate_entry(what[0], what[1])
                else:
                    pyfuse3.invalidate_inode(what, attr_only=True)
            except OSError:   # ENOENT: the kernel does not hold the inode or name
                pass
            except Exception:
                log.exception("telling the kernel to forget %r", what)
            finally:
                if isinstance(what, tuple):
                    self._sent += 1


def invalidate_attrs_now(ino: int) -> None:
    """The kernel forgets the attributes of the inode a request is about, before the reply
    (Loader.revalidated at open: the reader's first read must see the new size). Safe from a
    handler only for that inode: the kernel holds it for the request, so it is not being
    evicted."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=True)
    except OSError:
        pass


def make_operations(core: Core) -> Operations:
    """The adapter over ``core``."""
    global kernel_timeout
    kernel_timeout = min(ATTR_TIMEOUT, core.opts.coherence_timeout)
    return Operations(core)
