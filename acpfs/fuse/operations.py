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
from typing import Any, Callable

from . import fastwrite  # (before pyfuse3: it interposes fuse_session_new and _mount)
from . import attrtable, notices  # noqa: E402

import pyfuse3  # noqa: E402

from ..core.requests import Core  # noqa: E402
from ..node import Node  # noqa: E402

log = logging.getLogger(__name__)

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
            args[0].give_way.request()
        try:
            return await fn(*args)
        except Exception as e:
            raise pyfuse3.FUSEError(errno_of(e, fn.__name__)) from None
    return wrapper


def changes(fn: Callable) -> Callable:
    """A handler that changes inodes: where it fails, any of them may have changed halfway,
    so every answer kept below Python is removed (fuse/attrtable.py) before the reply. Where
    it succeeds, the handler itself says what changed (``offer``, ``attrtable.drop``)."""
    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except BaseException:
            attrtable.clear()
            raise
    return wrapper


def offer(core: Core, *nodes: Node) -> None:
    """The attributes of ``nodes`` were just answered (or changed by this request, which
    answers next): the kernel's next GETATTRs of them may be answered below Python while
    that answer holds (``Loader.answer_holds_for``, at most ``timeout_of``)."""
    if not attrtable.active():
        return
    for node in nodes:
        holds = min(timeout_of(core, node), core.loader.answer_holds_for(node))
        unseen = core.files.written_unseen(node)   # the kernel writes it: its memory file
        fd, seen = unseen if unseen is not None else (-1, None)
        if unseen is not None and fd < 0:
            holds = 0.0
        attrtable.put(node.ino, node.mode, node.nlink if not node.is_dir else dir_links(node),
                      node.uid, node.gid, node.rdev, node.size, node.atime, node.mtime,
                      node.ctime, holds, fd, seen or (-1, -1, -1))


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


FIELDS = ("st_ino", "entry_timeout", "attr_timeout", "st_mode", "st_nlink", "st_uid", "st_gid",
          "st_rdev", "st_size", "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns",
          "st_ctime_ns")


def timeout_of(core: Core, node: Node) -> float:
    """How long the kernel may keep the entry and attributes of ``node`` answered now: the
    kernel timeout, or, for a regular file with a change of this mount pending, until that
    lands (``KernelCacheNotices.hold``: nothing but this mount changes it until then)."""
    if node.is_reg and not core.cache.coherence.quiescent(node) and core.cache.kernel.hold(node):
        return notices.HOLD_TIMEOUT
    return notices.kernel_timeout


def fields(node: Node, ino: int, t: float) -> tuple:
    """A node's attributes under node id ``ino``, in the order of FIELDS, for the kernel to
    keep ``t`` seconds (``timeout_of``): what ``attrs`` fills in, and what a LOOKUP answered
    at once hands to the extension (_atonce.c)."""
    return (ino, t, t, node.mode, node.nlink if not node.is_dir else dir_links(node), node.uid,
            node.gid, node.rdev, node.size, BLKSIZE, (node.size + 511) // 512, node.atime,
            node.mtime, node.ctime)


def attrs(core: Core, node: Node) -> pyfuse3.EntryAttributes:
    """A node's attributes, its inode number as st_ino (a GETATTR reply)."""
    a = pyfuse3.EntryAttributes()
    for key, value in zip(FIELDS, fields(node, node.ino, timeout_of(core, node))):
        setattr(a, key, value)
    return a


def missing() -> pyfuse3.EntryAttributes:
    """A LOOKUP's answer for a name that is missing for sure (``Core.find``): a negative
    entry, which the kernel keeps for the coherence timeout and answers ENOENT from itself
    meanwhile (as NFS's lookupcache=all: a program that probes a missing name over and over,
    as SQLite its journal, costs no request)."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = 0
    a.entry_timeout = notices.kernel_timeout
    return a


def entry_fields(core: Core, node: Node) -> tuple:
    """``fields`` of a node the kernel will hold a reference to, as ``entry``."""
    return fields(node, core.inodes.looked_up(node), timeout_of(core, node))


def entry(core: Core, node: Node) -> pyfuse3.EntryAttributes:
    """Attributes of a node the kernel will hold a reference to (one lookup more), under
    the node id new lookups of it get (``Inodes.looked_up``): pyfuse3 sends st_ino as the
    node id, and the C extension shows the node's own inode number in its place."""
    a = attrs(core, node)
    a.st_ino = core.inodes.looked_up(node)
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
        self.give_way = core.flusher.give_way   # told of every request (flusher/giveway.py)

    # -- namespace -------------------------------------------------------------------------
    @replies
    async def lookup(self, parent_inode, name, ctx=None):
        kernel = self.core.cache.kernel
        kernel.looking(parent_inode, name)
        node = await self.core.find(parent_inode, name)
        if node is None:
            kernel.missing(parent_inode, name)
            return missing()
        offer(self.core, node)
        return entry(self.core, node)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            attrtable.drop(ino)
            self.core.forget(ino, n)

    @replies
    async def getattr(self, inode, ctx=None):
        node = await self.core.getattr(inode)
        offer(self.core, node)
        return attrs(self.core, node)

    @replies
    @acknowledges
    @changes
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = await self.core.setattr(
            inode,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime=attr.st_atime_ns if fields.update_atime else None,
            mtime=attr.st_mtime_ns if fields.update_mtime else None,
            caller_uid=ctx.uid)
        offer(self.core, node)
        return attrs(self.core, node)

    @replies
    async def readlink(self, inode, ctx):
        return self.core.readlink(inode)

    @replies
    @acknowledges
    @changes
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._made(parent_inode, await self.core.mkdir(parent_inode, name, mode, ctx))

    def _made(self, parent_inode: int, node: Node) -> pyfuse3.EntryAttributes:
        """The reply to a request that made ``node`` in directory ``parent_inode``."""
        self.fresh_in(parent_inode, node)
        return entry(self.core, node)

    def created_direct(self, fh: int, backing_id: int) -> bool:
        """Whether the open a CREATE made skips the page cache (direct_io)."""
        return self.handles.direct_io_mmap() and not backing_id \
            and not self.handles.handle(fh).page_cache

    def fresh_in(self, parent_inode: int, node: Node) -> None:
        """``node`` was made in directory ``parent_inode``: both answered anew below Python."""
        attrtable.drop(parent_inode)
        offer(self.core, node, *self._known(parent_inode))

    def unlinked(self, *parents: int) -> None:
        """A name left (or moved between) ``parents``: the file it named changed too."""
        attrtable.clear()
        offer(self.core, *self._known(*parents))

    def _known(self, *inos: int) -> list[Node]:
        """The nodes of ``inos`` the kernel holds (it holds a request's directories)."""
        return [n for n in map(self.core.inodes.nodes.get, inos) if n is not None]

    @replies
    @acknowledges
    @changes
    async def unlink(self, parent_inode, name, ctx):
        await self.core.unlink(parent_inode, name)
        self.unlinked(parent_inode)

    @replies
    @acknowledges
    @changes
    async def rmdir(self, parent_inode, name, ctx):
        await self.core.rmdir(parent_inode, name)
        self.unlinked(parent_inode)

    @replies
    @acknowledges
    @changes
    async def symlink(self, parent_inode, name, target, ctx):
        return self._made(parent_inode, await self.core.symlink(parent_inode, name, target, ctx))

    @replies
    @acknowledges
    @changes
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        await self.core.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                               noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE))
        self.unlinked(parent_inode_old, parent_inode_new)

    @replies
    @acknowledges
    @changes
    async def link(self, inode, new_parent_inode, new_name, ctx):
        node = await self.core.link(inode, new_parent_inode, new_name)
        self.unlinked(new_parent_inode)
        offer(self.core, node)
        return entry(self.core, node)

    @replies
    @acknowledges
    @changes
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._made(parent_inode, await self.core.mknod(parent_inode, name, mode, rdev, ctx))

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
            a = attrs(self.core, node)
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
    @changes
    async def open(self, inode, flags, ctx):
        fh, direct, backing_id = await self.handles.open(inode, flags, ctx.uid)
        offer(self.core, self.handles.handle(fh).node)   # (O_TRUNC changed it)
        info = pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=False)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            # a reader's close has nothing to stamp (Handles.flush) and no lock of the
            # daemon's to drop (POSIX locks are the kernel's): no FLUSH round trip
            fastwrite.reply_noflush()
        pass_through(self.core, backing_id)
        return info

    @replies
    @changes
    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, node, backing_id = await self.core.create(parent_inode, name, mode, flags, ctx)
        self.fresh_in(parent_inode, node)
        info = pyfuse3.FileInfo(fh=fh, direct_io=self.created_direct(fh, backing_id),
                                keep_cache=False)
        reply = info, entry(self.core, node)
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
        finally:
            h = self.handles.handles.get(fh)
            if h is not None:
                attrtable.drop(h.node.ino)   # (the extension dropped it on arrival too)

    @replies
    @acknowledges
    async def flush(self, fh):
        attrtable.drop(self.handles.handle(fh).node.ino)
        self.handles.flush(fh)   # close(): stamps what it acknowledges (Handles.flush)
        if self.core.replica_wait is not None:   # --replica-wait: and another node holds it
            await self.core.replica_wait()

    @replies
    @changes
    async def release(self, fh):
        node = self.handles.handle(fh).node
        attrtable.drop(node.ino)
        await self.handles.release(fh)
        self.core.cache.kernel.let_go(node)   # a writer's close that changed nothing
        offer(self.core, node)   # the last writer's close: its final size and times

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
    @changes
    async def setxattr(self, inode, name, value, ctx):
        await self.core.setxattr(inode, name, value)
        attrtable.drop(inode)   # its ctime

    @replies
    async def listxattr(self, inode, ctx):
        return await self.core.listxattr(inode)

    @replies
    @acknowledges
    @changes
    async def removexattr(self, inode, name, ctx):
        await self.core.removexattr(inode, name)
        attrtable.drop(inode)


def make_operations(core: Core) -> Operations:
    """The adapter over ``core``."""
    notices.kernel_timeout = min(notices.ATTR_TIMEOUT, core.opts.coherence_timeout)
    return Operations(core)
