"""Copies of backing files into the cache: ``acpfs preload`` (``preload``), and files read
from the backing kept once read (``keep``).

Owns the copies in flight: at most KEEPS files kept at a time (``_keeps``) and the worker
threads the copies take (``_fills``); one copy per file at a time is
``WriteThrough.copying``'s. Files read from a local backing wait for their copy in one queue
(``_resting``: readers still open or closed less than KEEP_QUIET ago), which one task
(``_keeper``) drains in batches, each copied in one idle thread: a task, a timer and a
thread per file cost more than the copy of a small file (2,000 cold 4 KiB files read and
opened again: 2.4-2.7 ms each with them, 1.1 ms without keeping anything). A copy is
several ranges at once where the backing is slow (``store.api.in_ranges``); a file is attached to its node only if the node still shows the
version copied (``Node.generation``), clean and evictable like any persisted file. What a
copy read is dropped from the backing's page cache when no open of the node reads the
backing file (``reading``; ``store.api.in_ranges``): RAM holds one copy of a file, not two.

Runs on the trio thread; the copies in worker threads.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import json
import logging
import os
import threading
from typing import Callable, Protocol

import trio

from ..cache.files import Files
from ..node import Node, err, node_path
from ..store.api import CacheFull, Content, fast_source
from .writethrough import WriteThrough

log = logging.getLogger(__name__)

# a file read from the backing is kept in the cache when it takes at most this share of it
KEEP_SHARE = 0.5
KEEPS = 8   # files copied into the cache after a read, at once
# seconds a file read from a fast backing rests after its last close before it is copied: a
# loader that mapped it touches its pages after the close (the mapping holds the backing
# file, not the open), and the copy must not take CPU or memory bandwidth from it
KEEP_QUIET = 1.0
# a batch of files copied from a local backing in one idle thread: at most this many files,
# and more than one only while they add up to at most BATCH_BYTES
BATCH_FILES = 64
BATCH_BYTES = 64 << 20


def when_idle(fn: Callable[[], None]) -> None:
    """Worker thread: ``fn()`` in a thread of its own that runs only on a CPU nothing else
    wants (SCHED_IDLE, where the kernel allows it); its exception is raised here."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
        try:
            fn()
        except BaseException as e:   # noqa: BLE001 (raised in the caller's thread)
            failed.append(e)
    t = threading.Thread(target=run, name="acpfs-keep", daemon=True)
    t.start()
    t.join()
    if failed:
        raise failed[0]


class Watch(Protocol):
    """Who watches a copy into the cache as it is made (``peerserve.Pull``)."""

    def started(self, content: Content) -> None: ...

    def copied(self, off: int, n: int) -> None: ...


class Fetch:
    def __init__(self, files: Files, wt: WriteThrough, reading: Callable[[Node], bool]) -> None:
        self.files = files
        self.wt = wt
        # whether opens of this node read its backing file now (ColdReads): while they do,
        # the backing's page cache is theirs; else a copy drops what it copied from it
        self.reading = reading
        self._nursery: trio.Nursery | None = None
        self._keeps = trio.CapacityLimiter(KEEPS)
        self._fills = trio.CapacityLimiter(KEEPS + 2)   # threads of keeps, probes and preloads
        self.kept = 0      # files kept after a read, since mount
        self.keeping = 0   # files to be kept: waiting for their readers, or being copied
        self.fetched = 0   # bytes copied from the backing into the cache (preloads, keeps)
        self._fetched_lock = threading.Lock()   # the copies' threads add to it
        # files read from a local backing, to be kept, in the order read: (node, version,
        # readers_gone, when they were first seen gone or None)
        self._resting: collections.deque[list] = collections.deque()
        self._rested = trio.Event()   # set when _resting gets a file

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        nursery.start_soon(self._keeper)

    async def preload(self, node: Node) -> bytes:
        """``user.acpfs.preload``: read a file's backing copy into the cache, for a fast resume.

        Never waits for the flusher: when the cache cannot hold the file even after evicting
        persisted files, the answer is ENOSPC at once. A preloaded file is clean and
        evictable like any persisted file.
        """
        if not node.is_reg:
            raise err(errno.EINVAL, "only regular files can be preloaded")
        if node.content is None and node.staged is None and node.size > self.files.store.limit:
            raise err(errno.EFBIG, "file larger than the cache")
        try:
            await self.copy_in(node)
        except CacheFull:
            raise err(errno.ENOSPC, "cache full") from None
        self.files.touch(node)
        return json.dumps({"size": node.size, "cached": node.content is not None}).encode()

    def keep(self, node: Node, fd: int, version: int, readers_gone: trio.Event) -> None:
        """After the first open of ``node`` read from its backing file ``fd`` (version
        ``version``): copy it into the cache in the background, if it takes at most
        KEEP_SHARE of the cache: from a local backing in ``_resting``'s turn, else by a task
        of its own (``_keep``)."""
        if self._nursery is not None and node.size <= self.files.store.limit * KEEP_SHARE:
            self.keeping += 1
            if self.files.backing.local_fstype is not None:
                self._resting.append([node, version, readers_gone, None])
                self._rested.set()
            else:
                self._nursery.start_soon(self._keep, node, os.dup(fd), version, readers_gone)

    async def _keep(self, node: Node, fd: int, version: int, readers_gone: trio.Event) -> None:
        """The next open reads the file from memory: from a slow backing the copy starts at
        once, several ranges at a time (the readers then find the bytes in the page cache);
        from a fast one (a local filesystem, or a timed read says so: ``fast_source``)
        KEEP_QUIET after its readers are gone, on idle CPU alone (``when_idle``), so that
        the copy never takes CPU from them. Not where there is no room without evicting
        what is not persisted, nor after a change."""
        try:
            # a local disk is never helped by parallel ranges: no probe beside the reader
            fast = self.files.backing.local_fstype is not None or \
                await trio.to_thread.run_sync(fast_source, fd, node.size, limiter=self._fills)
            if fast:
                os.close(fd)
                fd = -1
                await readers_gone.wait()
                await trio.sleep(KEEP_QUIET)
            async with self._keeps:
                if await self.copy_in(node, fd, version, fast, idle=fast):
                    self.kept += 1
        except CacheFull:
            log.debug("%s: not kept: no room in the cache", node_path(node))
        except OSError as e:   # changed or gone in the backing meanwhile: the next open sees
            log.debug("%s: not kept: %s", node_path(node), e)
        finally:
            self.keeping -= 1
            if fd >= 0:
                os.close(fd)

    async def _keeper(self) -> None:
        """Copies the files of ``_resting`` into the cache, in the order read, each once its
        readers are gone and KEEP_QUIET has passed (looked at every quarter of it), in
        batches (``_keep_batch``); a file whose readers stay holds up no other."""
        while True:
            if not self._resting:
                self._rested = trio.Event()
                await self._rested.wait()
            now = trio.current_time()
            batch, rest, size, seen = [], collections.deque(), 0, set()
            for entry in self._resting:
                node, version, gone_event, gone = entry
                if gone is None and gone_event.is_set():
                    entry[3] = gone = now
                if gone is None or now - gone < KEEP_QUIET or node.ino in seen or \
                        len(batch) == BATCH_FILES or (batch and size + node.size > BATCH_BYTES):
                    rest.append(entry)   # (a node twice: its second read waits a batch)
                    continue
                batch.append((node, version))
                seen.add(node.ino)
                size += node.size
            self._resting = rest
            if batch:
                await self._keep_batch(batch)
            else:
                await trio.sleep(KEEP_QUIET / 4)

    async def _keep_batch(self, batch: list[tuple[Node, int]]) -> None:
        """Copy files of a local backing (node, version) into the cache in one idle thread
        (``when_idle``), each only while its node still shows that version, neither cached
        nor staged, and there is room (``copy_in`` one by one)."""
        files, ready, copies = self.files, [], []
        try:
            async with contextlib.AsyncExitStack() as held:
                for node, version in batch:
                    await self.wt.settle(node)
                    await held.enter_async_context(self.wt.copying(node))
                    if not self._wanted(node, version):
                        continue
                    try:
                        ready.append((node, version, files.copy_up(node)))
                    except CacheFull:
                        log.debug("%s: not kept: no room in the cache", node_path(node))

                def fill_all() -> None:
                    for node, _, content in ready:
                        try:
                            files.read_backing_into(node, content, -1, True, self._copied,
                                                    lambda n=node: not self.reading(n))
                            copies.append(content)
                        except OSError as e:   # changed or gone in the backing meanwhile
                            log.debug("%s: not kept: %s", node_path(node), e)
                            copies.append(None)
                if ready:
                    async with self._keeps:
                        await trio.to_thread.run_sync(when_idle, fill_all, limiter=self._fills)
                for (node, version, content), copied in zip(ready, copies):
                    if copied is None:
                        files.release_content(content)   # the backing failed it
                    elif self._attach(node, version, content):
                        self.kept += 1
        finally:
            for _, _, content in ready[len(copies):]:
                files.release_content(content)       # never copied (cancelled)
            self.keeping -= len(batch)

    def _copied(self, off: int, n: int) -> None:
        with self._fetched_lock:
            self.fetched += n

    def status(self) -> dict:
        return {"kept": self.kept, "keeping": self.keeping, "fetched_bytes": self.fetched}

    async def copy_in(self, node: Node, fd: int = -1, version: int | None = None,
                      fast: bool | None = None, idle: bool = False,
                      watch: Watch | None = None) -> bool:
        """Copy the backing version of a file that is neither cached nor staged into the
        cache (raises CacheFull, or OSError from the backing); ``fd``: a descriptor of
        version ``version`` (``Node.generation``), copied only while the node shows it;
        ``fast``: whether the backing is, known already; ``idle``: on idle CPU alone
        (``when_idle``); ``watch``: told of the content being filled and of each range copied
        (any thread), so that it may serve what is copied already. Whether this call copied
        it."""
        files = self.files
        await self.wt.settle(node)
        if node.content is not None or node.staged is not None:
            return False
        async with self.wt.copying(node):
            if version is None:
                version = node.generation
            if not self._wanted(node, version):
                return False
            content = files.copy_up(node)
            if watch is not None:
                watch.started(content)
            try:
                def fill() -> None:
                    files.read_backing_into(node, content, fd, fast, self._copied if watch is None
                                            else lambda o, n: (self._copied(o, n), watch.copied(o, n)),
                                            lambda: not self.reading(node))
                await trio.to_thread.run_sync(functools.partial(when_idle, fill) if idle else fill,
                                              limiter=self._fills)
            except BaseException:
                files.release_content(content)
                raise
            return self._attach(node, version, content)

    @staticmethod
    def _wanted(node: Node, version: int) -> bool:
        """Whether a copy of version ``version`` of ``node`` is still to be made: the node
        shows it, and it is neither cached nor staged (nor removed)."""
        return node.content is None and node.staged is None and node.nlink > 0 \
            and node.generation == version

    def _attach(self, node: Node, version: int, content: Content) -> bool:
        """A copy of version ``version`` made: attached to ``node``, clean and evictable,
        unless another version came meanwhile (then dropped). Whether it was attached."""
        if node.generation != version or node.staged is not None:
            self.files.release_content(content)
            return False
        self.files.attach_content(node, content)
        self.files.maybe_evictable(node)
        return True
