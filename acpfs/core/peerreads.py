"""Files read from other nodes' RAM before the backing (``--peers-listen``; docs/design.md,
"Nodes serve each other from RAM"); what this node serves them is ``peerserve``'s.

Owns the reading side (``PeerReads``): an open for reading of a file this node does not
hold (neither cached nor staged, at least ``PEER_MIN`` bytes, at most the share of the
cache a kept file may take), after the open revalidated it against the backing, asks the
live nodes that serve a plane (their records carry the address: ``Peers.serving``) at once
what they have of it in the version the backing shows (inode, size, mtime):

- one or more *hold* it: it is copied from one of them, picked at random (later readers
  spread over the earlier ones, each of which serves in turn), ``PEER_STREAMS`` ranges at
  once, into the cache; the open then reads it from the cache.
- none holds it: one node, the file's *leader* (``leader``: the same on every node),
  copies it from the backing in parallel ranges for the job (asked to by the first node
  that wants it: ``_start``), and the others copy it from the leader's RAM as its copy
  grows (the leader serves the prefix it has). So the backing serves each byte of a
  checkpoint about once however many nodes load it.

A copy is attached only if the node still shows the version asked for. A peer that fails
(no answer within the client's timeout, a refusal, an answer that is not signed or names
another version or range, a short body, a copy from the backing that stops) costs a
fallback: the next holder, then the backing (the usual cold path); and it is not asked
again for ``SKIP_FAILED`` seconds. The answers are signed, the bytes are not: a node that
holds the backing's secret is trusted with them, as with the backing itself, and the
bytes cross the network as the backing's own do (docs/design.md).

Counters for status and metrics (``status``): opens that asked, waited, fetched and fell
back; bytes fetched; the last failure of each peer (``FAILURES_KEPT`` at most).

Runs on the trio thread; the questions and the copies in worker threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import threading
import time
from typing import Any

import trio

from ..cache.files import Files
from ..cache.inodes import Inodes
from ..cluster.peers import Peers
from ..cluster.plane import Plane, Version, version_text
from ..cluster.remote import PeerError, Remote
from ..node import Node, node_path
from ..store.api import CacheFull, in_ranges
from .fetch import KEEP_SHARE
from .peerserve import PeerServing
from .writethrough import WriteThrough

log = logging.getLogger(__name__)

PEER_MIN = 1 << 20        # bytes: a smaller file is read from the backing (one round trip)
PEER_STREAMS = 4          # ranges of one file fetched from a peer at once
FAILURES_KEPT = 16        # peers whose last failure status shows
SKIP_FAILED = 30.0        # s a peer that failed is not asked again
PEER_THREADS = 16         # worker threads asking and copying from peers, at most


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
    def __init__(self, files: Files, inodes: Inodes, wt: WriteThrough, parts: PeerPlane,
                 serving: PeerServing) -> None:
        self.files = files
        self.inodes = inodes
        self.wt = wt
        self.peers = parts.peers
        self.plane = parts.plane
        self.remote = parts.remote    # None: files are neither read from peers nor served
        self.why_not = parts.why_not
        self.serving = serving        # this node's side: what it holds, what it pulls
        self.fetched_files = 0
        self.fetched_bytes = 0
        self.fallbacks = 0      # opens that asked peers and read the backing after all
        self.asked = 0          # opens that asked peers
        self.waited = 0         # opens that waited for another node's pull
        self.failures: dict[str, str] = {}   # peer address -> its last failure
        self._failed_at: dict[str, float] = {}   # peer address -> when (monotonic)
        self._lock = threading.Lock()        # fetched_bytes, failures (worker threads)
        # the threads that ask and copy: their own, not the backing calls' (a stalled peer
        # never holds up a read of the backing)
        self._threads = trio.CapacityLimiter(PEER_THREADS)

    def start(self, nursery: trio.Nursery) -> None:
        """On the FUSE loop: the plane may now find files (before, it answers 404)."""
        self.serving.start(nursery)
        if self.remote is not None:
            self.plane.holder = self.serving

    # -- reading from peers (trio thread) ---------------------------------------------------
    def wants(self, node: Node) -> bool:
        """Whether an open for reading of ``node`` asks the peers first."""
        return (self.remote is not None and node.is_reg and node.content is None
                and node.staged is None and not node.writers and node.backing_parent is not None
                and PEER_MIN <= node.size <= self.files.store.limit * KEEP_SHARE
                and bool(self._serving()))

    def _serving(self) -> list[str]:
        """The planes to ask: the live nodes' that did not fail in the last SKIP_FAILED s
        (a dead host costs one timeout, not one per open, until its lease runs out)."""
        with self.peers.lock:
            addresses = [r.address for r in self.peers.serving()]
        now = time.monotonic()
        with self._lock:
            return [a for a in addresses if now - self._failed_at.get(a, -SKIP_FAILED) >= SKIP_FAILED]

    async def fetch_or_not(self, node: Node) -> None:
        """``fetch``; whatever goes wrong there, the open reads the backing (logged)."""
        try:
            await self.fetch(node)
        except OSError as e:   # the cache or the backing, meanwhile: the usual path sees
            log.debug("%s: not read from a peer: %s", node_path(node), e)
        except Exception:
            log.exception("%s: reading it from a peer failed; reading the backing", node_path(node))
            self.fallbacks += 1

    async def fetch(self, node: Node) -> bool:
        """Bring ``node`` (revalidated just before) into the cache from a peer that holds the
        version the backing shows, or, where none does, by its leader's one copy from the
        backing (this node's own ``serving.pull``, or another's, waited for); whether it is
        cached now. Never raises for a peer: the caller reads the backing where this
        returns False."""
        version = node.backing_version
        addresses = self._serving()
        if version is None or not addresses or not self.wants(node):
            return False
        with self.inodes.position_lock:
            path = b"/".join(self.inodes.backing_path(node.backing_parent) + [node.backing_name])
        self.asked += 1
        began = time.monotonic()
        holders, pulling, answered = await trio.to_thread.run_sync(
            self._ask_all, addresses, path, version, limiter=self._threads)
        if not holders:   # the leader among the nodes that answered (a dead one cannot pull)
            first = leader(path, version, answered + [self.plane.address])
            if first == self.plane.address and not pulling:
                if await self.serving.pull(node, path, version):
                    return True
                self.fallbacks += 1
                return False
            self.waited += 1
            where = pulling[0] if pulling else first
            if not pulling and not await trio.to_thread.run_sync(self._start, where, path, version,
                                                                 limiter=self._threads):
                self.fallbacks += 1
                return False
            holders = [where]   # its copy's prefix comes as it grows
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
                got = await trio.to_thread.run_sync(self._copy, holders, path, version, content,
                                                    limiter=self._threads)
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
            log.debug("%s: %d bytes from the RAM of %s in %.3f s", node_path(node), node.size,
                      got, time.monotonic() - began)
            return True

    def _ask_all(self, addresses: list[str], path: bytes,
                 version: Version) -> tuple[list[str], list[str], list[str]]:
        """Worker thread: the peers of ``addresses`` that hold ``path`` in ``version``, those
        copying it from the backing now (each list in random order, so that readers spread
        over them), and all that answered, asked at once."""
        assert self.remote is not None
        found: dict[str, list[str]] = {"held": [], "pulling": [], "": []}
        answered: list[str] = []

        def ask(address: str) -> None:
            try:
                state, _ = self.remote.ask(address, path, version)
                found[state].append(address)
                answered.append(address)
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
        for got in found.values():
            random.shuffle(got)
        return found["held"], found["pulling"], answered

    def _start(self, address: str, path: bytes, version: Version) -> bool:
        """Worker thread: ask the peer at ``address``, the file's leader, to copy ``path`` in
        ``version`` from the backing for the job; whether it holds or copies it now."""
        assert self.remote is not None
        try:
            return bool(self.remote.ask(address, path, version, pull=True)[0])
        except PeerError as e:
            self._failed(address, e)
            return False
        finally:
            self.remote.close()

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
            self._failed_at[address] = time.monotonic()
            while len(self.failures) > FAILURES_KEPT:
                self.failures.pop(next(iter(self.failures)))

    def status(self) -> dict:
        with self._lock:
            failures = dict(self.failures)
            fetched = self.fetched_bytes
        return {"on": self.remote is not None, "why_not": self.why_not,
                "address": self.plane.address, "asked": self.asked, "waited": self.waited,
                "fetched_files": self.fetched_files, "fetched_bytes": fetched,
                "fallbacks": self.fallbacks, **self.serving.status(), **self.plane.status(),
                "failed_peers": failures}


def leader(path: bytes, version: Version, addresses: list[str]) -> str:
    """The node that copies ``path`` in ``version`` from the backing for the job when none
    holds it: the same on every node that sees the same planes (rendezvous hashing: each
    file its own leader, spread over the nodes)."""
    key = b"%s\0%s" % (path, version_text(version).encode())
    return max(addresses, key=lambda a: hashlib.sha256(key + b"\0" + a.encode()).digest())
