"""Open files and directories: the handles, and the requests made on them.

Owns the file handles (``handles``: fh -> ``Handle``, with the backing descriptor of a reader
of an uncached file and the version it holds), the directory handles (``dirs``: the
entries at opendir), numbered from one counter, and the opens of each kernel inode
(``kernel_opens``). Opens of uncached files for reading go to ``coldreads.ColdReads``
(passed through to the backing file, or read by the daemon from it). The requests on them: open (whether the
kernel passes the file through to its memory file: ``_passthrough``; content a snapshot
still holds is copied for a writer first: ``unshared``), read, write (``write_now``
straight from libfuse's buffer, else ``write``), fallocate, flush (what close()
acknowledges is journaled and stamped), release, fsync and preload; and counting what
writers passed through wrote (``passwriters``).

Runs on the trio thread (trio, no pyfuse3). A file's content is ``files.Files``'s; changes
while the cache is full, and staged files, go through ``writethrough.WriteThrough``;
backing reads run in worker threads. ``Handle.backing_fd`` is closed on the trio thread
(docs/concurrency.md, Known gaps).
"""

from __future__ import annotations

import errno
import logging
import os
import stat as statmod
import time
from typing import Callable

import trio

from ..config import Options
from ..cache.admission import Admission
from ..cache.files import Files
from .coldreads import ColdReads, Kernel, Served
from .fetch import Fetch
from .loader import Loader
from .longopen import LongOpen
from .passwriters import count_passthrough_writes
from .peerreads import PeerReads
from .readnow import ReadsNow
from .unshare import unshared
from ..cache.inodes import Inodes
from ..cache.namespace import Namespace
from ..oplog.log import OpLog
from ..node import Node, err, node_path
from .writethrough import WriteThrough

FALLOC_FL_KEEP_SIZE = 0x01
log = logging.getLogger(__name__)

PRIV_BITS = statmod.S_ISUID | statmod.S_ISGID


# the largest file a read-write open keeps in the kernel's page cache (``_page_cache``): a
# second copy that small costs little; a larger one (an array mapped read-write) is passed
# through, where the kernel maps the memory file itself
PAGE_CACHE_MAX = 16 << 20


class Handle:
    """An open file."""
    __slots__ = ("node", "nodeid", "writable", "append", "backing_fd", "generation", "kill_priv",
                 "passthrough", "opened_seq", "cold", "page_cache")

    def __init__(self, node: Node, writable: bool, append: bool = False,
                 kill_priv: bool = False, passthrough: bool = False, nodeid: int = 0) -> None:
        self.node = node
        self.nodeid = nodeid or node.ino   # the kernel inode it was opened on
        self.cold = False                  # the kernel passes it through to the backing file
        self.page_cache = False            # the kernel reads it through its page cache
        self.writable = writable
        self.passthrough = passthrough   # the kernel reads and writes its memory file itself
        self.opened_seq = 0              # OpLog.seq at the open
        self.append = append         # opened with O_APPEND
        self.kill_priv = kill_priv   # opened by a user other than root: its writes clear setuid
        self.backing_fd = -1         # the backing copy, for files not in the cache
        self.generation = 0          # Node.generation when backing_fd was opened



class Handles:
    def __init__(self, inodes: Inodes, files: Files, names: Namespace, loader: Loader,
                 wt: WriteThrough, longopen: LongOpen, opts: Options, *,
                 kernel: Kernel | None, direct_io_mmap: Callable[[], bool],
                 admission: Admission) -> None:
        self.inodes = inodes
        self.files = files
        self.oplog: OpLog = files.oplog
        self.backing = files.backing
        self.names = names          # setuid and setgid cleared by a write
        self.loader = loader
        self.wt = wt
        self.longopen = longopen    # a staged copy of a file passed through goes at its close
        self.opts = opts            # fsync_backing
        self.kernel = kernel   # passthrough (passthrough.py); None: every request comes here
        self.admission = admission   # which writers may be passed through
        self.direct_io_mmap = direct_io_mmap   # asked at each open: the INIT reply decides
        self.handles: dict[int, Handle] = {}
        self.reads_now = ReadsNow(files, loader.calls)
        self.cold = ColdReads(inodes, files, kernel, loader.calls)   # uncached files read by the kernel
        # copies of backing files into the cache
        self.fetch = Fetch(files, wt, lambda node: node.ino in self.cold.opens_of)
        # opens of each kernel inode (node id), counted from the start of the open: the kernel
        # allows only one kind of open per kernel inode (passthrough or not, one backing file)
        self.kernel_opens: dict[int, int] = {}
        # inode -> its opens in the kernel's page-cache mode (``_page_cache``)
        self.page_cached: dict[int, int] = {}
        self.dirs: dict[int, list[tuple[bytes, Node]]] = {}
        self._next_fh = 1
        # files read from other nodes' RAM before the backing (``peerreads``); set by Core
        self.peer_reads: PeerReads | None = None

    def start(self, nursery: trio.Nursery) -> None:
        self.fetch.start(nursery)
        if self.kernel is not None:
            nursery.start_soon(count_passthrough_writes, self.files, self.admission)

    def handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if h is None:
            raise err(errno.EBADF, f"file handle {fh} is not open")
        return h

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    async def opendir(self, ino: int) -> int:
        loader = self.loader
        node = await loader.refreshed(await loader.loaded(self.inodes.known(ino)))
        fh = self._new_fh()
        self.dirs[fh] = list(node.entries().items())
        return fh

    def dir_entries(self, fh: int) -> list[tuple[bytes, Node]]:
        entries = self.dirs.get(fh)
        if entries is None:
            raise err(errno.EBADF, f"directory handle {fh} is not open")
        return entries

    def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    async def open(self, ino: int, flags: int, uid: int = 0) -> tuple[int, bool, int]:
        """Open a file: (file handle, whether the kernel should bypass its page cache, the
        backing id the kernel passes the file through to, or 0)."""
        node = self.inodes.known(ino)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        # Close-to-open: the backing is looked at now. The first reader of a file the cache
        # does not hold opens the backing file, which checks the version itself (ESTALE
        # where it is another): one worker-thread trip, not a stat and then an open. Any
        # error there takes the usual way, a stat first (Loader.revalidated)
        checked = writable or bool(node.links) \
            or not self.cold.first(ino, node, self.kernel_opens.get(ino, 0))
        if not checked and self.peer_reads is not None and self.peer_reads.wants(node):
            # another node may hold the version the backing shows: from its RAM, if so
            node = await self.loader.revalidated(node, at_open=True)
            await self.peer_reads.fetch_or_not(node)
            checked = True
        while True:
            if checked:
                node = await self.loader.revalidated(node, at_open=True)
            if node.is_dir:
                raise err(errno.EISDIR)
            if node.parent is None and node.content is None and node.staged is None \
                    and node.backing_parent is None:
                # another writer removed it and a listing took it out of the view while the
                # kernel still held its name: the kernel looks the name up again
                raise err(errno.ESTALE, "another writer removed the file in the backing")
            await self.wt.settle(node)
            self.cold.conflicts(ino, node, writable)   # ESTALE: the kernel opens another inode
            claimed = self.cold.claim(ino, node, writable, self.kernel_opens.get(ino, 0))
            if not checked and claimed != "open":   # it changed meanwhile
                checked = True
                continue
            self.kernel_opens[ino] = self.kernel_opens.get(ino, 0) + 1
            try:
                opened = await self._open(ino, node, flags, uid, claimed, checked)
            except OSError:
                self.closed_on(ino)
                if checked or claimed != "open":
                    raise
                checked = True
                continue
            except BaseException:
                self.closed_on(ino)
                raise
            if not checked:
                node.checked_at = time.monotonic()   # as Loader.revalidated would have
            return opened

    def opened_cold(self, ino: int, node: Node, served: Served, claimed: str, append: bool) -> int:
        """The handle of a read-only open passed through to the backing file (``ColdReads``):
        the first open of its kernel inode (``claimed`` "open") queues the copy kept once
        its readers are gone (``Fetch.keep``)."""
        if claimed == "open":
            self.fetch.keep(node, served.fd, served.generation, served.idle)
        self.files.open(node, False, False)
        h = Handle(node, False, append, nodeid=ino)
        h.cold = True
        h.backing_fd = served.fd   # ColdReads owns it
        fh = self._new_fh()
        self.handles[fh] = h
        return fh

    def closed_on(self, nodeid: int) -> None:
        left = self.kernel_opens[nodeid] - 1
        if left:
            self.kernel_opens[nodeid] = left
        else:
            del self.kernel_opens[nodeid]

    async def _open(self, ino: int, node: Node, flags: int, uid: int,
                    claimed: str, checked: bool) -> tuple[int, bool, int]:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC) and writable
        append = bool(flags & os.O_APPEND)
        if claimed:
            served = await self.cold.open(ino, node, claimed)
            if served is not None:
                return self.opened_cold(ino, node, served, claimed, append), False, served.backing_id
            if not checked:   # it changed meanwhile: compared with the backing first (open)
                raise err(errno.ESTALE, f"{node_path(node)} changed while it was opened")
        if writable:
            await self.loader.xattrs_loaded(node)
            while True:   # until the content is cached or staged, and private, at once
                await self.wt.open_for_writing(node, trunc)
                if await unshared(self.files, self.wt, node, trunc):
                    break
        # direct_io only where shared mmap survives it (the kernel granted it in INIT:
        # Linux 6.9+ with the fast write extension; elsewhere a shared writable mapping of a
        # direct_io file fails with ENODEV, which breaks SQLite's WAL and np.memmap).
        # There, writers get it (1 MiB requests straight into the cache, no page cache cap),
        # and readers of a cached file (one copy from the cache into the reader's buffer,
        # where the page cache copies twice and allocates a page per 4 KiB), except a file
        # opened for reading and writing at once (``_page_cache``). Files read from the
        # backing keep the page cache and its read-ahead, except beside passthrough, where
        # a file must not enter the page cache's mode.
        h, direct, backing_id = self.prepared(ino, node, flags, uid)
        if not writable and node.content is None and node.staged is None and node.is_reg:
            # Open the backing copy now, so that the reader keeps the version it opened
            # even if the file is renamed over, deleted or republished meanwhile.
            await self._open_backing(h, verify=True)
        return self.registered(h, flags), direct, backing_id

    def prepared(self, ino: int, node: Node, flags: int, uid: int) -> tuple[Handle, bool, int]:
        """The handle of an open that waits for nothing more (the content is where the open
        needs it), whether the kernel bypasses its page cache for it, and the backing id it
        is passed through to (0: none)."""
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC) and writable
        append = bool(flags & os.O_APPEND)
        if not node.writers and (node.content is not None or node.backing_parent is not None):
            self.admission.learn(node)   # a closed version: the size its name has
        cached = self._page_cache(node, flags)
        backing_id = 0 if cached else self._passthrough(node, writable, trunc, append)
        direct = not cached and self.direct_io_mmap() and (writable or node.content is not None
                                                           or self.kernel is not None)
        h = Handle(node, writable, append, kill_priv=writable and uid != 0,
                   passthrough=bool(backing_id), nodeid=ino)
        h.page_cache = cached
        h.opened_seq = self.oplog.seq
        return h, direct and not backing_id, backing_id

    def registered(self, h: Handle, flags: int) -> int:
        """Count ``h`` as open (``Files.open``, ``handles``): its file handle."""
        node, writable = h.node, h.writable
        trunc = bool(flags & os.O_TRUNC) and writable
        self.files.open(node, writable, trunc, h.append and writable, passthrough=h.passthrough)
        if h.kill_priv and node.mode & PRIV_BITS and (trunc or h.passthrough):
            # O_TRUNC by a user other than root clears them (the kernel leaves that to the
            # daemon with FUSE_HANDLE_KILLPRIV_V2), and so would a write passed through,
            # which never comes here: cleared at the open
            self.names.kill_priv(node)
        if h.passthrough and writable:
            self.files.note_change(node)   # its first write never comes here: dirty from the open
        fh = self._new_fh()
        self.handles[fh] = h
        self._entered(h)
        return fh

    def _entered(self, h: Handle) -> None:
        """Count ``h`` among its file's opens in page-cache mode (``page_cached``)."""
        if h.page_cache:
            self.page_cached[h.node.ino] = self.page_cached.get(h.node.ino, 0) + 1

    def _page_cache(self, node: Node, flags: int) -> bool:
        """Whether an open gets the kernel's page cache, served by the daemon (neither
        direct_io nor passed through): a file of at most PAGE_CACHE_MAX bytes opened for
        reading and writing at once (a database: SQLite reads its header and fstats its file
        at every transaction, and the kernel asks for the attributes again after every read
        it does not serve from its page cache) when nothing else has it open, and every open
        of it after that until its last close, so that all opens of a file share one page
        cache. Its writes still reach the daemon at once (no writeback cache); each open
        without keep_cache drops what the page cache held, so another node's version is
        read at the next open (docs/semantics.md, section 10)."""
        if not node.is_reg or node.passthrough_opens:
            return False   # (the kernel refuses an inode opens of both kinds)
        if self.page_cached.get(node.ino):
            return True
        return (flags & os.O_ACCMODE) == os.O_RDWR and node.size <= PAGE_CACHE_MAX \
            and node.opens == self.cold.opens_of.get(node.ino, 0)

    def _passthrough(self, node: Node, writable: bool, trunc: bool = False,
                     append: bool = False) -> int:
        """The backing id an open of ``node`` is passed through to, or 0 for an open the
        daemon serves. The kernel fails an open with EIO when an inode has opens of both
        kinds (or two backing files), so every open of a file open with passthrough is
        passed through to the same memory file, and a file open through the daemon stays so
        until its last close. A writer is passed through only when ``Admission.admit`` says
        (the kernel's writes are counted only when the daemon next looks); else it takes the
        daemon's path, where a full cache makes it wait or write through to the backing."""
        kernel, files = self.kernel, self.files
        if kernel is None or not node.is_reg or node.content is None or node.staged is not None:
            return 0
        if node.passthrough_opens:
            return node.content.backing_id
        # opens passed through to the backing file are on kernel inodes of their own
        if node.opens - self.cold.opens_of.get(node.ino, 0) or not kernel.granted():
            return 0
        if writable and not self.admission.admit(node, trunc, append):
            return 0
        try:
            return files.store.backing(node.content, kernel.register)
        except OSError as e:
            log.warning("%s: cannot pass it through (%s); served by the daemon", node_path(node), e)
            return 0

    def open_created(self, node: Node, flags: int) -> tuple[int, int]:
        """The open of a file ``Core.create`` just made: (file handle, the backing id as
        ``open``); its handle says whether it has the page cache (``Handle.page_cache``)."""
        append = bool(flags & os.O_APPEND)
        # The creating handle always counts as a writer, so that the new file is
        # published at its last close even when it was opened read-only.
        cached = self._page_cache(node, flags)
        backing_id = 0 if cached else self._passthrough(node, True, append=append)
        self.files.open(node, True, False, append, passthrough=bool(backing_id))
        fh = self._new_fh()
        h = self.handles[fh] = Handle(node, True, append, passthrough=bool(backing_id),
                                      nodeid=node.nodeid)
        h.page_cache = cached
        self._entered(h)
        self.kernel_opens[node.nodeid] = self.kernel_opens.get(node.nodeid, 0) + 1
        return fh, backing_id

    def read_now(self, fh: int, off: int, size: int) -> bytes | memoryview | None:
        """A READ answered at once, or None for ``read`` (core/readnow.py)."""
        return self.reads_now.read(self.handle(fh), off, size)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self.handle(fh)
        node = h.node
        if h.cold:   # the version it opened, whatever the cache holds since
            return await trio.to_thread.run_sync(self.backing.read, h.backing_fd, size, off)
        if node.staged is not None:
            data = await self.wt.read_staged(node, off, size)
            if data is not None:
                return data
        data = self.reads_now.from_cache(node, off, size)
        if data is not None:
            return data
        if self.reads_now.to_reopen(h):
            await self._open_backing(h)
        return await trio.to_thread.run_sync(self.backing.read, h.backing_fd, size, off)

    async def _open_backing(self, h: Handle, verify: bool = False) -> None:
        """(Re)open the backing copy of the handle's file for reading; ``verify``: the very
        version the mount knows, else ESTALE (an open looks the name up again)."""
        node = h.node
        version = node.generation   # read before: a publish meanwhile only reopens once more
        fd = await self.loader.calls.run(self.files.open_backing_copy, node, verify)
        if h.backing_fd >= 0:
            self.backing.close_fd(h.backing_fd)
        h.backing_fd, h.generation = fd, version

    def write_now(self, fh: int, off: int, data: memoryview) -> int | None:
        """A WRITE straight from libfuse's buffer: bytes written, or None to take the async
        path (``write``). ``data`` is valid only during this call: it is copied into the files."""
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
        self.files.sync_content(node)
        if mode & FALLOC_FL_KEEP_SIZE or end <= node.size:
            return 0
        if node.content is None or not self.wt.in_cache(node) or self.files.shared_in_kernel(node):
            return -errno.EOPNOTSUPP
        self._clear_priv(h)
        self.files.truncate(node, end)
        return 0

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handle(fh)
        self._clear_priv(h)
        return await self.wt.write(h.node, h.node.size if h.append else off, buf)

    def _clear_priv(self, h: Handle) -> None:
        """Before a change of content through ``h``: clears setuid/setgid (``kill_priv``)
        if it was opened by a user other than root."""
        if h.kill_priv and h.node.mode & PRIV_BITS:
            self.names.kill_priv(h.node)

    def flush(self, fh: int) -> None:
        """close(): what it acknowledges is journaled and stamped here.

        close() returns when FLUSH is answered; RELEASE, which queues the file, follows
        without being waited for. So the content close() acknowledges is journaled here
        (Files.record_close) and stamped for global order (OpLog.note_ack). No waiting for
        a staged file being built: the cached content stays valid until it is complete, and the
        record holds them. A FLUSH whose RELEASE does not follow (the close of a copy of
        the descriptor in a forked process) is queued by ``_queue_late_acks``.
        """
        h = self.handles.get(fh)
        if h is None or not h.writable or h.node.writers != 1 or not h.node.dirty:
            return
        self.files.sync_content(h.node)
        self.files.record_close(h.node)
        self.oplog.note_ack(h.node)

    async def release(self, fh: int) -> None:
        h = self._let_go(fh)
        if h is None:
            return
        if h.writable:
            await self.wt.settle(h.node)
        self._released(h)
        node = h.node
        if h.writable and not node.writers and node.open_copy is not None:
            await self.longopen.closed(node)

    def release_now(self, fh: int) -> bool:
        """``release`` where it waits for nothing (no write-through holds the file, no copy
        of a long-open file to hand over): True; False, with nothing done, where it must."""
        h = self.handles.get(fh)
        if h is None or (h.writable and (h.node.ino in self.wt.slots
                                         or h.node.open_copy is not None)):
            return False
        if self._let_go(fh) is not None:
            self._released(h)
        return True

    def _let_go(self, fh: int) -> Handle | None:
        """The first steps of a RELEASE: the handle, no longer open; None where a reader
        passed through to the backing file is all done with."""
        h = self.handles.pop(fh, None)
        if h is None:
            raise err(errno.EBADF, f"file handle {fh} is not open")
        self.closed_on(h.nodeid)
        node = h.node
        if h.page_cache:
            left = self.page_cached[node.ino] - 1
            if left:
                self.page_cached[node.ino] = left
            else:
                del self.page_cached[node.ino]
        if h.cold:
            self.cold.release(h.nodeid, node)
            self.files.release(node, False)
            return None
        return h

    def _released(self, h: Handle) -> None:
        node = h.node
        self.files.sync_content(node)
        if h.passthrough and h.writable and node.writers == 1 and not node.dirty and node.nlink \
                and node.last_seq > h.opened_seq:
            # queued while open (a close() whose RELEASE did not follow: a mapping or a forked
            # process kept the file): what they wrote since never came here
            self.files.note_change(node)
        if h.writable and node.writers == 1:
            self.admission.learn(node)   # the last writer's close: its name's new size
        try:
            self.files.release(node, h.writable, h.append and h.writable, h.passthrough)
        finally:
            if h.backing_fd >= 0:
                self.backing.close_fd(h.backing_fd)

    async def fsync(self, fh: int) -> None:
        if self.opts.fsync_backing:
            await self.wt.fsync(self.handle(fh).node)
