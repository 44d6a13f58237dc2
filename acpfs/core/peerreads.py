"""Files read from another node's RAM before the backing, and this node's files served to
the others (``--peers-listen``; docs/design.md, "Nodes serve each other from RAM").

Owns the peer plane's two sides as the core sees them (``PeerReads``):

- **Reading.** An open for reading of a file this node does not hold (neither cached nor
  staged, at least ``PEER_MIN`` bytes, at most the share of the cache a kept file may take),
  after the open revalidated it against the backing, asks the live nodes that serve a plane
  (their records carry the address: ``Peers.serving``) at once which of them holds it in the
  version the backing shows (inode, size, mtime). The file is copied from one of them into
  the cache, in ``PEER_STREAMS`` ranges at once, and the open then reads it from the cache;
  the next peer is tried if one fails, and the backing (the usual cold path) if all do, or
  if none holds it. A copy is attached only if the node still shows the version asked for.
  So the backing serves each byte of a file about once however many nodes load it: a node
  that copied it serves it in turn, and a node that asks picks among the holders at random,
  so later readers spread over the earlier ones.
- **Serving.** ``hold`` (a plane thread, through the FUSE loop) finds a file by its path in
  the backing among the loaded directories, with no backing I/O, and takes a reference to
  its bytes (``Store.share``) only when it is clean in the version asked for: persisted, no
  writer, nothing queued. ``let_go`` gives it back.

Counters for status and metrics (``status``): files and bytes fetched from peers, opens that
fell back to the backing, and the last failure of each peer.

Runs on the trio thread; the copies and the questions in worker threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from typing import Any, Iterator

import trio

from ..cache.files import Files
from ..cache.inodes import Inodes
from ..cluster.peers import Peers
from ..cluster.plane import Plane, Version
from ..cluster.remote import PeerError, Remote
from ..node import Node, node_path
from ..store.api import CacheFull, in_ranges
from .fetch import KEEP_SHARE
from .writethrough import WriteThrough

log = logging.getLogger(__name__)

PEER_MIN = 1 << 20        # bytes: a smaller file is read from the backing (one round trip)
PEER_STREAMS = 4          # ranges of one file fetched from a peer at once
FAILURES_KEPT = 16        # peers whose last failure status shows


@dataclasses.dataclass(frozen=True)
class PeerPlane:
    """The parts of the peer plane the daemon built: the node records (who serves a plane,
    and where), this node's server, the client (None where no secret could be used), and
    why the plane is off where it is."""
    peers: Peers
    plane: Plane
    remote: Remote | None
    why_not: str | None = None


class PeerReads:
    def __init__(self, files: Files, inodes: Inodes, wt: WriteThrough, parts: PeerPlane) -> None:
        self.files = files
        self.inodes = inodes
        self.wt = wt
        self.peers = parts.peers
        self.plane = parts.plane
        self.remote = parts.remote    # None: files are neither read from peers nor served
        self.why_not = parts.why_not
        self._token: trio.lowlevel.TrioToken | None = None
        self.fetched_files = 0
        self.fetched_bytes = 0
        self.fallbacks = 0      # opens that asked peers and read the backing after all
        self.asked = 0          # opens that asked peers
        self.failures: dict[str, str] = {}   # peer address -> its last failure
        self._lock = threading.Lock()        # fetched_bytes (copy threads)

    def start(self) -> None:
        """On the FUSE loop: the plane may now find files (before, it answers 404)."""
        self._token = trio.lowlevel.current_trio_token()
        if self.remote is not None:
            self.plane.holder = self

    # -- reading from peers (trio thread) ---------------------------------------------------
    def wants(self, node: Node) -> bool:
        """Whether an open for reading of ``node`` asks the peers first."""
        return (self.remote is not None and node.is_reg and node.content is None
                and node.staged is None and not node.writers and node.backing_parent is not None
                and PEER_MIN <= node.size <= self.files.store.limit * KEEP_SHARE
                and bool(self._serving()))

    def _serving(self) -> list[str]:
        with self.peers.lock:
            return [r.address for r in self.peers.serving()]

    async def fetch(self, node: Node) -> bool:
        """Copy ``node`` (revalidated just before) from a peer that holds the version the
        backing shows into the cache; whether it is cached now. Never raises for a peer:
        the caller reads the backing where this returns False."""
        version = node.backing_version
        addresses = self._serving()
        if version is None or not addresses or not self.wants(node):
            return False
        with self.inodes.position_lock:
            path = b"/".join(self.inodes.backing_path(node.backing_parent) + [node.backing_name])
        self.asked += 1
        holders = await trio.to_thread.run_sync(self._holders, addresses, path, version)
        if not holders:
            self.fallbacks += 1
            return False
        await self.wt.settle(node)
        async with self.wt.copying(node):
            generation = node.generation
            if not (self.wants(node) and node.backing_version == version):
                return node.content is not None
            try:
                content = self.files.copy_up(node)
            except CacheFull:
                self.fallbacks += 1
                return False
            try:
                got = await trio.to_thread.run_sync(self._copy, holders, path, version, content)
            except BaseException:
                self.files.release_content(content)
                raise
            if got is None or node.generation != generation or node.staged is not None \
                    or node.backing_version != version:
                self.files.release_content(content)
                self.fallbacks += 1
                return False
            self.files.attach_content(node, content)
            self.files.maybe_evictable(node)
            self.fetched_files += 1
            log.debug("%s: %d bytes from the RAM of %s", node_path(node), node.size, got)
            return True

    def _holders(self, addresses: list[str], path: bytes, version: Version) -> list[str]:
        """Worker thread: the peers of ``addresses`` that hold ``path`` in ``version``, asked
        at once, in random order (so that readers spread over the holders)."""
        assert self.remote is not None
        found: list[str] = []

        def ask(address: str) -> None:
            try:
                if self.remote.has(address, path, version):
                    found.append(address)
            except PeerError as e:
                self._failed(address, e)
            finally:
                self.remote.close()
        threads = [threading.Thread(target=ask, args=(a,), name="acpfs-peer-ask", daemon=True)
                   for a in addresses]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        random.shuffle(found)
        return found

    def _copy(self, holders: list[str], path: bytes, version: Version, content: Any) -> str | None:
        """Worker thread: the bytes of ``path`` into ``content`` from the first of
        ``holders`` that serves them whole; which one, or None if none did."""
        assert self.remote is not None
        remote, size = self.remote, version[1]
        for address in holders:
            local = threading.local()

            def get(off: int, n: int) -> None:
                buf = getattr(local, "buf", None)
                if buf is None:
                    buf = local.buf = memoryview(bytearray(1 << 20))
                remote.get(address, path, version, off, n, put, buf)
                with self._lock:
                    self.fetched_bytes += n
            try:
                with self.files.store.sink(content, size) as put:
                    in_ranges(size, get, streams=PEER_STREAMS, fast=False)
                return address
            except PeerError as e:
                self._failed(address, e)
            finally:
                remote.close()   # this thread's; the ranges' threads end with their copy
        return None

    def _failed(self, address: str, e: PeerError) -> None:
        log.warning("peer plane: %s; reading from the backing instead", e)
        with self._lock:
            self.failures.pop(address, None)
            self.failures[address] = f"{time.strftime('%H:%M:%S')} {e}"
            while len(self.failures) > FAILURES_KEPT:
                self.failures.pop(next(iter(self.failures)))

    # -- serving the others (plane threads) -------------------------------------------------
    def hold(self, path: bytes, version: Version) -> tuple[Any, int] | None:
        token = self._token
        if token is None:
            return None
        try:
            return trio.from_thread.run_sync(self._hold, path, version, trio_token=token)
        except trio.RunFinishedError:
            return None

    def _hold(self, path: bytes, version: Version) -> tuple[Any, int] | None:
        node: Node | None = self.inodes.root
        for name in path.split(b"/"):
            children = node.children if node is not None else None
            node = children.get(name) if children is not None else None
        if node is None or not node.is_reg or node.content is None or node.staged is not None \
                or node.dirty or node.publish_ops or node.writers or node.nlink < 1 \
                or node.backing_version != version or node.size != version[1]:
            return None
        store = self.files.store
        with self.files.oplog.lock:
            ref = store.share(node.content)
        self.files.touch(node)
        return ref, node.size

    @contextlib.contextmanager
    def runs(self, ref: Any, size: int) -> Iterator[tuple[int, Iterator[tuple[int, int, int]]]]:
        with self.files.store.source(ref, size) as got:
            yield got

    def let_go(self, ref: Any) -> None:
        with self.files.oplog.lock:
            self.files.store.drop(ref)

    def status(self) -> dict:
        with self._lock:
            failures = dict(self.failures)
            fetched = self.fetched_bytes
        return {"on": self.remote is not None, "why_not": self.why_not,
                "address": self.plane.address, "asked": self.asked,
                "fetched_files": self.fetched_files, "fetched_bytes": fetched,
                "fallbacks": self.fallbacks, **self.plane.status(), "failed_peers": failures}
