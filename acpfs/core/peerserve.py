"""This node's files as the other nodes' peer plane requests see them (``--peers-listen``;
docs/design.md, "Nodes serve each other from RAM"): the ``Holder`` of ``cluster.plane``.

Owns the pulls: copies from the backing into this cache that this node makes for the whole
job (``pulls``: (path, version) -> ``Pull``, its bytes copied so far). When several nodes
open a file that none of them holds, one of them (the *leader*, the same for every node:
``peerreads.leader``) copies it from the backing, in parallel ranges (``Fetch.copy_in``),
and the others wait for it and copy it from its RAM: the backing serves each byte once,
not once per node. The leader pulls when its own open asks for the file (``pull``) or when
another node's question asks it to (``state`` with ``pull``), whichever comes first; the
other waits for the same copy.

What a request gets:

- ``state`` (HEAD): 200 when this node holds the file in the version asked, clean
  (persisted, no writer, nothing queued); 202 while it pulls that version (with the bytes
  copied so far, so that a waiting node sees it progress); 404 otherwise.
- ``hold`` (GET): a reference to the bytes as they are (``Store.share``: a writer that opens
  the file later writes a copy), given back by ``let_go``; ``runs`` says where they lie.

A file is found by its path in the backing among the directories this node has loaded,
without backing I/O; a pull asked for by another node looks the path up like any lookup
(``find``: revalidated against the backing).

Runs on the trio thread; the plane's threads call in through ``trio.from_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from typing import Any, Awaitable, Callable, Iterator

import trio

from ..backing.names import is_internal_name
from ..cache.files import Files
from ..cache.inodes import Inodes
from ..cluster.plane import Version
from ..node import Node, node_path
from ..store.api import CacheFull
from .fetch import KEEP_SHARE, Fetch

log = logging.getLogger(__name__)

HELD, PULLING, ABSENT = 200, 202, 404   # what ``state`` answers
FAILED_SEEN = 0.1   # s: a range waited for sees a failed pull this late at most


class Pull:
    """A copy from the backing this node makes for the job (a ``fetch.Watch``): the content
    it fills, its bytes so far, the prefix copied whole (the ranges come in any order, from
    several threads: ``_ranges`` holds those past it), whether it failed, and when it ended
    (``done``). What the prefix holds is served while the rest is copied (``ready``)."""
    __slots__ = ("done", "content", "copied_bytes", "prefix", "failed", "_ranges", "_lock")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.content: Any = None
        self.copied_bytes = 0
        self.prefix = 0
        self.failed = False
        self._ranges: dict[int, int] = {}
        self._lock = threading.Condition(threading.Lock())   # notified as the prefix grows

    def started(self, content: Any) -> None:
        self.content = content

    def copied(self, off: int, n: int) -> None:
        with self._lock:
            self.copied_bytes += n
            self._ranges[off] = n
            if self.prefix in self._ranges:
                while self.prefix in self._ranges:
                    self.prefix += self._ranges.pop(self.prefix)
                self._lock.notify_all()

    def ready(self, end: int, wait: float = 0.0) -> bool | None:
        """(Any thread) whether bytes up to ``end`` are copied, waiting up to ``wait`` s for
        them (woken as the prefix grows: a waiting range costs no CPU); None if they never
        will be (a failure is seen within FAILED_SEEN s)."""
        if self.prefix < end and not self.failed and wait > 0:
            with self._lock:
                self._lock.wait_for(lambda: self.prefix >= end or self.failed,
                                    min(wait, FAILED_SEEN))
        if self.prefix >= end:
            return True
        return None if self.failed else False


class PeerServing:
    def __init__(self, files: Files, inodes: Inodes, fetch: Fetch,
                 find: Callable[[int, bytes], Awaitable[Node | None]]) -> None:
        self.files = files
        self.inodes = inodes
        self.fetch = fetch
        self.find = find     # Core.find: a name in a directory, revalidated
        self.pulls: dict[tuple[bytes, Version], Pull] = {}
        self.pulled_files = 0     # files this node copied from the backing for the job
        self.pulled_bytes = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._lock = threading.Lock()   # pulled_bytes

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()

    # -- the plane's threads ----------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        token = self._token
        if token is None:
            return None
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            return None

    def state(self, path: bytes, version: Version, pull: bool) -> tuple[int, int]:
        """(HELD, size), (PULLING, bytes so far) or (ABSENT, 0); ``pull``: start pulling
        the file if this node neither holds nor pulls it."""
        return self._call(self._state, path, version, pull) or (ABSENT, 0)

    def hold(self, path: bytes, version: Version) -> tuple[Any, int, Callable[[int], bool | None]] | None:
        return self._call(self._hold, path, version)

    @contextlib.contextmanager
    def runs(self, ref: Any, size: int) -> Iterator[tuple[int, Iterator[tuple[int, int, int]]]]:
        with self.files.store.source(ref, size) as got:
            yield got

    def let_go(self, ref: Any) -> None:
        with self.files.oplog.lock:
            self.files.store.drop(ref)

    # -- on the trio thread -----------------------------------------------------------------
    def _held(self, path: bytes, version: Version) -> Node | None:
        node: Node | None = self.inodes.root
        for name in names_of(path):
            children = node.children if node is not None else None
            node = children.get(name) if children is not None else None
        if node is None or not node.is_reg or node.content is None or node.staged is not None \
                or node.dirty or node.publish_ops or node.writers or node.nlink < 1 \
                or node.backing_version != version or node.size != version[1]:
            return None
        return node

    def _hold(self, path: bytes, version: Version) -> tuple[Any, int, Callable[[int], bool | None]] | None:
        """(a reference to the bytes, the size, whether bytes up to an offset are there yet):
        of the file held, or of the one being pulled, whose prefix is served as it grows."""
        node = self._held(path, version)
        store = self.files.store
        if node is None:
            pull = self.pulls.get((path, version))
            if pull is None or pull.failed:
                return None
            if pull.content is None:   # its copy has not begun: nothing to hold yet
                return None, version[1], pull.ready
            with self.files.oplog.lock:   # (its copy releases it on this thread: not now)
                ref = store.share(pull.content)
            return ref, version[1], pull.ready
        with self.files.oplog.lock:
            ref = store.share(node.content)
        self.files.touch(node)
        return ref, node.size, _always

    def _state(self, path: bytes, version: Version, pull: bool) -> tuple[int, int]:
        if self._held(path, version) is not None:
            return HELD, version[1]
        got = self.pulls.get((path, version))
        if got is not None:
            return PULLING, got.copied_bytes
        if not pull or self._nursery is None or not names_of(path) \
                or version[1] > self.files.store.limit * KEEP_SHARE:
            return ABSENT, 0
        got = self.pulls[(path, version)] = Pull()
        self._nursery.start_soon(self._pull_asked, path, version, got)
        return PULLING, 0

    async def _pull_asked(self, path: bytes, version: Version, pull: Pull) -> None:
        """Another node asked this one, the leader, to pull ``path``: look it up (as a lookup
        would) and copy it in, if it is the version asked for."""
        node: Node | None = self.inodes.root
        try:
            for name in names_of(path):
                node = await self.find(node.ino, name) if node is not None else None
            if node is not None and node.is_reg and node.backing_version == version:
                await self._copy(node, pull, version)
        except OSError as e:
            log.debug("peer plane: %s asked by another node, not pulled: %s",
                      path.decode(errors="replace"), e)
        except Exception:   # a bug: this node reads on, the asker reads the backing
            log.exception("peer plane: pulling %s for another node failed",
                          path.decode(errors="replace"))
        finally:
            pull.failed = pull.failed or node is None or node.content is None
            del self.pulls[(path, version)]
            pull.done.set()

    async def pull(self, node: Node, path: bytes, version: Version) -> bool:
        """Copy ``node`` (``path`` in ``version``) from the backing into the cache for the job
        (this node is its leader), or wait for the pull under way; whether it is cached."""
        pull = self.pulls.get((path, version))
        if pull is None:
            pull = self.pulls[(path, version)] = Pull()
            try:
                await self._copy(node, pull, version)
            except OSError as e:
                log.debug("%s: not pulled: %s", node_path(node), e)
            finally:
                pull.failed = pull.failed or node.content is None
                del self.pulls[(path, version)]
                pull.done.set()
        else:
            await pull.done.wait()
        return node.content is not None and node.backing_version == version

    async def _copy(self, node: Node, pull: Pull, version: Version) -> None:
        """Copy ``node`` into the cache for ``pull``, from a descriptor of the backing file
        that is ``version`` (its inode, size and mtime checked on the descriptor itself): a
        change of the file meanwhile fails the pull, never fills it with another version
        that its followers would take for this one."""
        began = time.monotonic()
        generation = node.generation
        fd = -1
        try:
            if node.backing_version != version:
                raise OSError(errno.ESTALE, "another version in the backing")
            fd = await trio.to_thread.run_sync(self.files.open_backing_copy, node, True)
            st = os.fstat(fd)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != version or node.generation != generation:
                raise OSError(errno.ESTALE, "another version in the backing")
            copied = await self.fetch.copy_in(node, fd, generation, watch=pull)
        except CacheFull:
            pull.failed = True
            raise OSError(errno.ENOSPC, "no room in the cache") from None
        except BaseException:
            pull.failed = True
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        pull.failed = node.content is None
        log.debug("%s: %s from the backing for the job in %.3f s", node_path(node),
                  "copied" if copied else "not copied", time.monotonic() - began)
        if copied:
            self.pulled_files += 1
            with self._lock:
                self.pulled_bytes += node.size

    def status(self) -> dict:
        return {"pulled_files": self.pulled_files, "pulled_bytes": self.pulled_bytes,
                "pulling": len(self.pulls)}


def _always(end: int, wait: float = 0.0) -> bool:
    return True


def names_of(path: bytes) -> list[bytes]:
    """The names of a path a peer asked for, relative to the backing; none (the root, which
    is no file: nothing is served) if one is empty, ``.``, ``..``, or acpfs's own
    (``is_internal_name``)."""
    names = path.split(b"/")
    if len(path) > 4096 or any(not n or n in (b".", b"..") or b"\0" in n or is_internal_name(n)
                               for n in names):
        return []
    return names
