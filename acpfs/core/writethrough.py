"""Write-through and the full cache: what becomes of a file's content when RAM cannot hold it.

Owns the policy that keeps writers going at the backing's speed instead of failing:

- ``with_space``: a change that needs space waits, while the cache is full, for the flusher
  to persist and free some, writing the largest open file through to make room; after
  ``cache_full_timeout`` seconds without progress the writer gets ENOSPC.
- writing a file through (``write_through``): an open file's cached content is copied to a
  *staged file* in the backing's staging directory (``Backing.create_staged``); from then
  on its reads, writes, truncates and fsyncs go to that file, and its last close hands it to
  the flusher, which publishes it in order like any upload. A file larger than half the
  cache is staged when it is opened for writing (``cached``), never copied into RAM.
Files open for writing for a long time are ``longopen``'s; it writes them through here.

The staging slot. Every change of a staged file, and building one, holds the node's slot
(``hold``); every request that changes the node, and its last writer's release, waits in
``settle`` until it is given back. Invariant: one holder at a time; a caller takes the slot
with no await since it last found it free. Calls on a staged file's descriptor go through
``on_staged``, which pins it (``Staged.users``) so that a publish or discard meanwhile
closes the descriptor only afterwards. docs/concurrency.md has the races this prevents.

Owns the counters of what went to the backing this way (``written_files``, ``written_bytes``:
the content copied at write-through, writes to staged files since; status: ``write_through``).

Runs on the trio thread (trio, no pyfuse3); backing I/O runs in worker threads through
``Backing``. ``tests/unit/test_writethrough.py`` drives it with a backing that hangs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import trio

from ..cache.files import Files
from ..store.api import CacheFull
from ..node import Node, Staged, err, node_path

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_FAILED_AFTER = 10.0   # seconds before a file whose write-through failed is tried again
START_WRITE_THROUGH = 0.2   # seconds a writer waits for free space before writing through
# seconds a copy into the cache for a writer waits for free space that nothing will free (no
# file can be written through: the cache is held by writers the kernel passes through, or by
# files being uploaded) before the copy goes to the backing instead (``cached``)
SPILL_COPY_AFTER = 1.0


class Slot:
    """A node's staging slot, taken by ``WriteThrough.hold``: what holds it, since when."""
    __slots__ = ("done", "why", "since")

    def __init__(self, why: str) -> None:
        self.done = trio.Event()
        self.why = why
        self.since = time.monotonic()


class StagedClosed(Exception):
    """The staged file was published or discarded (closed) before it could be used."""


class Background:
    """Background tasks that request handlers start, run in the nursery the daemon's trio
    loop hands to ``run``. Built before that loop exists: a task started earlier waits in
    the channel until then."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel(math.inf)

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        self._send.send_nowait((fn, args))

    async def run(self, nursery: trio.Nursery) -> None:
        async for fn, args in self._receive:
            nursery.start_soon(fn, *args)


class WriteThrough:
    def __init__(self, files: Files, background: Background, cache_full_timeout: float,
                 waited_for: Callable[[int], None] = lambda seq: None) -> None:
        self.files = files
        self.waited_for = waited_for   # the flusher gives way to nobody then (giveway.py)
        self.background = background
        self.backing = files.backing
        self.cache_full_timeout = cache_full_timeout
        self.slots: dict[int, Slot] = {}      # ino -> its staging slot, while held
        self.failed: dict[int, float] = {}    # ino -> when writing it through last failed
        self._full_since = 0.0
        self._copy_locks: dict[int, trio.Lock] = {}
        self.written_files = 0                # files written through since mount
        self.written_bytes = 0                # bytes written to the backing by write-through

    def status(self) -> dict[str, int]:
        """The counters, as ``status`` shows them (``write_through``)."""
        return {"files": self.written_files, "bytes": self.written_bytes}

    # -- the staging slot ----------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def hold(self, node: Node, why: str) -> AsyncIterator[None]:
        """Hold the node's staging slot while its staged file is built or changed."""
        if node.ino in self.slots:   # a bug: the request fails with EIO, logged
            raise RuntimeError(f"staging slot of {node_path(node)!r} taken twice")
        slot = self.slots[node.ino] = Slot(why)
        try:
            yield
        finally:
            del self.slots[node.ino]
            slot.done.set()

    async def settle(self, node: Node, deadline: float = math.inf) -> None:
        """Wait until nobody holds the node's staging slot; ENOSPC at ``deadline`` (trio
        clock) when the backing does not finish in time."""
        slot = self.slots.get(node.ino)
        while slot is not None:
            with trio.move_on_at(deadline):
                await slot.done.wait()
            if not slot.done.is_set():
                log.error("%s: %s has taken %.0fs so far (is the backing hanging? see 'acpfs "
                          "status'): a write waiting for it gets ENOSPC", node_path(node),
                          slot.why, time.monotonic() - slot.since)
                raise err(errno.ENOSPC, "cache full and the backing is not answering")
            slot = self.slots.get(node.ino)

    def busy(self, node: Node) -> bool:
        """Writes to the node cannot go straight to the cache: it is staged or being staged."""
        return node.staged is not None or node.ino in self.slots

    async def on_staged(self, sp: Staged, fn: Callable[..., T], *args: Any) -> T:
        """``fn(sp.fd, *args)`` (a ``Backing`` call) in a worker thread, with the staged file
        pinned; raises StagedClosed if it is closed already."""
        lock = self.files.oplog.lock
        with lock:
            if sp.closing or sp.fd < 0:
                raise StagedClosed()
            sp.users += 1
        try:
            return await trio.to_thread.run_sync(fn, sp.fd, *args)
        finally:
            with lock:
                sp.users -= 1
                if sp.closing and not sp.users:
                    sp.close(self.backing.close_fd)

    @staticmethod
    def staged_gone(node: Node, sp: Staged) -> None:
        """After StagedClosed: a closed staged file must have left its node, else going
        around again would never end."""
        if node.staged is sp:
            raise err(errno.EIO, "staged file closed while still in use")

    def may_write_through(self, node: Node) -> bool:
        return (node.writers > 0 and node.staged is None and node.content is not None
                and not node.passthrough_opens
                and node.ino not in self.failed and node.ino not in self.slots)

    # -- the full cache ------------------------------------------------------------------
    async def with_space(self, fn: Callable[[], T], node: Node | None = None,
                         spill: bool = False) -> T | None:
        """Call ``fn``; while the cache is full, wait for the flusher to free space.

        Writers are throttled to the backing store's speed this way. After
        ``cache_full_timeout`` seconds without progress they get ENOSPC; ``spill``: None
        after SPILL_COPY_AFTER seconds in which no file could be written through (the
        caller writes to the backing instead).
        """
        try:
            return fn()
        except CacheFull:
            pass
        start = time.monotonic()
        if not self._full_since:
            self._full_since = start
            log.info("cache full (%d MiB): writers wait for the flusher to persist and free space",
                     self.files.store.limit >> 20)
        delay = 0.001
        while True:
            await trio.sleep(delay)
            delay = min(delay * 2, 0.05)
            # Try again first: the sleep may have freed enough (a file written through
            # meanwhile). Picking a victim first wrote through files whose write now fit.
            try:
                result = fn()
                self._full_since = 0.0
                return result
            except CacheFull:
                pass
            if time.monotonic() - start > START_WRITE_THROUGH:
                now = time.monotonic()
                for ino, when in list(self.failed.items()):
                    if now - when > RETRY_FAILED_AFTER:
                        del self.failed[ino]
                victim = self.files.write_through_candidate(exclude=self.failed)
                if victim is None and node is not None and self.may_write_through(node):
                    victim = node   # e.g. one write larger than the free cache
                if victim is not None and victim.ino not in self.slots:
                    # in the background: on a hung backing this writer still gets its ENOSPC
                    self.start_write_through(victim)
                    await trio.sleep(0)   # let it take its slot
                elif victim is None and spill and time.monotonic() - start > SPILL_COPY_AFTER:
                    return None
            if time.monotonic() - start > self.cache_full_timeout:
                log.error("cache full for %.0fs and nothing can be freed: returning ENOSPC "
                          "(is the backing store failing? see 'acpfs status')",
                          time.monotonic() - start)
                raise err(errno.ENOSPC, "cache full")

    # -- staging -------------------------------------------------------------------------
    async def _stage(self, node: Node, fill: Callable[[int], None], why: str) -> Staged | None:
        """Create a staged file for ``node`` in the backing's staging directory.

        ``fill(fd)`` runs in a worker thread and writes the file's current content, with the
        node's slot held; the node only gets its staged file once it is complete, and only
        if nothing replaced its content meanwhile. Returns None if staging failed.
        """
        files, backing = self.files, self.backing
        tmp = backing.staged_name(node.ino)
        content_before = node.content

        def run() -> tuple[int, int]:
            dfd, fd = backing.create_staged(tmp)
            try:
                fill(fd)
            except BaseException:
                backing.close_fd(fd)
                backing.remove_temp(dfd, tmp)
                backing.close_fd(dfd)
                backing.remove_staging_dir()
                raise
            return dfd, fd

        async with self.hold(node, why):
            try:
                dfd, fd = await trio.to_thread.run_sync(run)
            except OSError as e:
                log.warning("cannot %s %s (%s); it stays in the cache", why, node_path(node), e)
                return None
            sp = Staged(dfd, fd, tmp)
            if node.staged is not None or node.content is not content_before:
                files.oplog.discard(sp)
                return None
            node.staged = sp
            return sp

    async def write_through(self, node: Node) -> bool:
        """Write a large open file through to the backing, freeing its cached content.

        Its content is copied to a staged file; from then on its writes and reads go to that
        file (at the backing's speed) and its last close hands the file to the flusher.
        """
        files, backing = self.files, self.backing
        if not self.may_write_through(node):   # its last writer may have closed it since
            return False
        with files.oplog.lock:
            content = files.store.share(node.content)
        size = node.size

        def fill(fd: int) -> None:
            with files.store.source(content, size) as (src_fd, extents):
                backing.copy_extents(fd, extents, src_fd)
            backing.truncate(fd, size)

        try:
            sp = await self._stage(node, fill, "write through")
        finally:
            files.release_content(content)
        if sp is None:
            self.failed[node.ino] = time.monotonic()
            return False
        with files.oplog.lock:
            if node.content is not None:
                files.store.drop(node.content)
            node.content = None
        self.written_files += 1
        self.written_bytes += size
        log.info("cache full: writing %s through to the backing from now on (%d MiB were cached)",
                 node_path(node), size >> 20)
        return True

    def start_write_through(self, node: Node) -> None:
        self.background.start_soon(self._write_through_logged, node)

    async def _write_through_logged(self, node: Node) -> None:
        try:
            await self.write_through(node)
        except Exception:
            log.exception("internal error writing %s through to the backing", node_path(node))

    async def _stage_copy(self, node: Node) -> None:
        """Open a file larger than half the cache for writing: copy its backing version into
        a staged file."""
        files, backing = self.files, self.backing
        size = node.size

        def fill(fd: int) -> None:
            src = files.open_backing_copy(node)
            try:
                backing.copy_file(src, fd, size)
            finally:
                backing.close_fd(src)

        if await self._stage(node, fill, "copy for writing") is None and node.staged is None \
                and node.content is None:
            raise err(errno.EIO, "cannot stage a copy of this file for writing")

    async def cached(self, node: Node) -> None:
        """Bring the content of a file into the cache (before it is modified).

        A file whose last version is a staged file still being published is waited for; a
        file larger than half the cache is staged instead, and so is one for which no room
        can be made (``with_space``'s ``spill``).
        """
        files = self.files
        while True:
            await self.settle(node)
            if node.content is not None:
                return
            sp = node.staged
            if sp is None:
                break
            if not sp.queued:
                return
            await self.wait_seq(node.last_seq)   # then look again: others ran meanwhile
        # Nothing is staging the node, and no await since settle: _stage_copy may stage it.
        if node.size > files.store.limit // 2:
            await self._stage_copy(node)
            return
        async with self.copying(node):
            if node.content is None and node.staged is None:
                content = await self.with_space(lambda: files.copy_up(node), spill=True)
                if content is None:   # nothing will free the room: the copy goes to the backing
                    await self._stage_copy(node)
                    return
                try:
                    await trio.to_thread.run_sync(files.read_backing_into, node, content)
                except BaseException:
                    files.release_content(content)
                    raise
                if node.content is None and node.staged is None:
                    files.attach_content(node, content)
                else:   # staged meanwhile (its size changed): that copy wins
                    files.release_content(content)

    @contextlib.asynccontextmanager
    async def copying(self, node: Node) -> AsyncIterator[None]:
        """One copy into the cache per file at a time (``cached`` and ``Fetch.copy_in``);
        whoever holds it looks again whether the copy is still needed."""
        lk = self._copy_locks.get(node.ino)
        if lk is None:
            lk = self._copy_locks[node.ino] = trio.Lock()
        try:
            async with lk:
                yield
        finally:
            self._copy_locks.pop(node.ino, None)

    async def wait_seq(self, seq: int) -> None:
        """Until the flusher has applied op ``seq``."""
        oplog = self.files.oplog
        self.waited_for(seq)
        delay = 0.001
        while oplog.applied_seq < seq:
            await trio.sleep(delay)
            delay = min(delay * 2, 0.05)

    # -- changes of a file's content -------------------------------------------------------
    def in_cache(self, node: Node) -> bool:
        """The file's content is changed in the cache alone: not staged in the backing, and
        no staging of it under way."""
        return node.staged is None and node.ino not in self.slots

    def write_now(self, node: Node, off: int, data: bytes | memoryview) -> int | None:
        """A write that needs no waiting: into the cache, or None when it must wait (for free
        space or a staged file: ``write``)."""
        if not self.in_cache(node):
            return None
        try:
            return self.files.write(node, off, data)
        except CacheFull:
            return None

    async def write(self, node: Node, off: int, buf: bytes) -> int:
        n = self.write_now(node, off, buf)
        if n is not None:
            return n
        files = self.files
        deadline = trio.current_time() + self.cache_full_timeout
        while True:
            await self.settle(node, deadline)
            sp = node.staged
            if sp is not None:
                # held: a truncate of the staged file and this write never overlap (the size
                # kept would not match the file's)
                async with self.hold(node, "write to its staged copy"):
                    files.note_change(node)
                    try:
                        n = await self.on_staged(sp, self.backing.write, buf, off)
                    except StagedClosed:
                        self.staged_gone(node, sp)
                        continue
                    files.mark_written(node, off + n)
                    self.written_bytes += n
                return n
            # None: the node started being written through while we waited; go around
            if len(buf) > files.store.limit // 2 and self.may_write_through(node):
                self.start_write_through(node)   # this write alone nearly fills the cache
                await trio.sleep(0)
                continue
            n = await self.with_space(
                lambda: None if self.busy(node) else files.write(node, off, buf), node)
            if n is not None:
                return n

    async def truncate(self, node: Node, size: int) -> None:
        """Set a regular file's size (setattr), whatever holds its content."""
        files = self.files
        # Each pass looks at the node afresh: other requests, the flusher and eviction run
        # at every await.
        while True:
            await self.settle(node)
            sp = node.staged
            if sp is not None and sp.queued:
                await self.wait_seq(node.last_seq)   # its last version is being published
                continue
            if sp is None and node.content is None and size:
                if not node.nlink and not node.opens:
                    node.size = size   # deleted and dropped meanwhile: nothing to keep
                    return
                await self.cached(node)   # (again, if it was evicted while we waited)
                continue
            if sp is not None:
                # The slot keeps the last writer's release (which would hand the staged file
                # to the flusher) and every write waiting until the file is cut.
                async with self.hold(node, "truncate of its staged copy"):
                    files.note_change(node)
                    try:
                        await self.on_staged(sp, self.backing.truncate, size)
                    except StagedClosed:
                        self.staged_gone(node, sp)
                        continue   # discarded (the file was deleted): look again
                    node.size = size
                    files.mark_written(node, size)
                    if node.writers == 0 and node.nlink:
                        files.snapshot(node)
                return
            # False: the node was staged or evicted while we waited for space; go around
            if await self.with_space(
                    lambda: False if self.busy(node) or (size and node.content is None)
                    else files.truncate(node, size) or True, node):
                return

    async def open_for_writing(self, node: Node, trunc: bool) -> None:
        """Before ``Files.open`` of a writer: the content is cached or staged; with O_TRUNC a
        staged file not yet handed over is cut here (``Files.open`` cuts the rest)."""
        await self.settle(node)
        if not trunc:
            await self.cached(node)
            return
        sp = node.staged
        if sp is not None and not sp.queued:
            # held: the last other writer's release must not hand the file over half cut
            async with self.hold(node, "truncate of its staged copy"):
                self.files.note_change(node)
                try:
                    await self.on_staged(sp, self.backing.truncate, 0)
                except StagedClosed:
                    self.staged_gone(node, sp)   # discarded: Files.open truncates the rest
                else:
                    node.size = 0
                    self.files.mark_written(node, 0)

    async def read_staged(self, node: Node, off: int, size: int) -> bytes | None:
        """Bytes of a staged file; None if it is not staged, or was published meanwhile."""
        sp = node.staged
        if sp is None:
            return None
        try:
            return await self.on_staged(sp, self.backing.read, size, off)
        except StagedClosed:
            return None

    async def fsync(self, node: Node) -> None:
        """``fsync`` with ``--fsync backing``: until the file's content is durable."""
        await self.settle(node)
        sp = node.staged
        if sp is not None and not sp.queued:
            # written through: the bytes so far become durable in the staged file; the file
            # is renamed into place at its last close
            try:
                await self.on_staged(sp, self.backing.fsync)
                return
            except StagedClosed:
                pass    # published meanwhile (this handle is read-only): wait for that
        await self.wait_seq(self.files.fsync_snapshot(node))
