"""What the kernel may keep of this mount's answers, and what it is told to drop.

Owns the kernel timeout (how long the kernel may answer names and attributes from its own
caches: ``kernel_timeout``, set once by ``operations.make_operations``) and
``KernelCacheNotices``, the cache's notices to the kernel of changes another node made:
pyfuse3's invalidations, sent from a thread of their own, and the answers kept below Python
dropped with them (fuse/attrtable.py).

Answers held until a change lands: the entry and attributes of a regular file this mount has
a change of pending (created or written and not yet in the backing; docs/semantics.md,
section 10: no other node's change can show in this mount's view of it until then) are
given for ``HOLD_TIMEOUT`` instead of the kernel timeout, so that the ``stat`` and the
``unlink`` of a file just written cost no LOOKUP and no GETATTR however long the flusher
takes. Once its change lands, what the kernel holds is what the backing holds at that
moment, as an answer given then: the kernel is told to drop both (``run``, ``let_go``) once
the kernel timeout from then has nearly run out, so no answer it keeps is older than that;
a writer's close that leaves nothing pending, or a file with no name left, is let go at
once. ``ACPFS_NO_HOLD=1`` turns this off.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import Callable

import trio

from . import attrtable  # (with fastwrite, which must be loaded before pyfuse3)

import pyfuse3  # noqa: E402

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
HOLD_TIMEOUT = 60.0   # s: what the kernel may keep of a file whose change is pending (held)
HOLD_POLL = 0.1       # s: how often what landed is looked at, while some file is held


class KernelCacheNotices(KernelNotices):
    """What the cache tells the kernel of changes another node made (``Cache.kernel``):
    pyfuse3's notifications. Owns the names the kernel was told are missing
    (``_missing``: (directory node id, name) -> until when the kernel may keep that answer),
    so that one another node makes is dropped from the kernel's cache as soon as this node
    sees it (``appeared``), the invalidations in flight (``_queued``, ``_sent``), and the
    files whose answers the kernel was given until their change lands (``_held``, module
    docstring)."""

    def __init__(self) -> None:
        # an inode (its attributes), or (directory, name, counted): an entry; counted ones
        # are what ``settled`` waits for
        self._forgets: queue.SimpleQueue[int | tuple[int, bytes, bool]] = queue.SimpleQueue()
        self._missing: dict[tuple[int, bytes], float] = {}
        self._queued = 0   # entry invalidations queued (trio thread)
        self._sent = 0     # of those, sent (the notification thread)
        self._hold_on = not os.environ.get("ACPFS_NO_HOLD")
        self._held: dict[int, Node] = {}   # ino -> node answered until it lands (trio thread)
        self._landed: collections.deque[Node] = collections.deque()   # from the flusher's thread
        # (when to let go, node) of held files whose change landed, in time order (trio thread)
        self._leaving: collections.deque[tuple[float, Node]] = collections.deque()
        self._quiescent: Callable[[Node], bool] | None = None   # set by run()
        self._some_held = trio.Event()
        self.held_released = 0   # files whose held answers were dropped (status)
        threading.Thread(target=self._send_forgets, name="acpfs-forget", daemon=True).start()

    # -- answers held until a change lands (module docstring) -------------------------------
    def hold(self, node: Node) -> bool:
        if not self._hold_on or self._quiescent is None or kernel_timeout <= 0:
            return False
        if node.ino not in self._held:
            self._held[node.ino] = node
            self._some_held.set()
        return True

    def landed(self, node: Node) -> None:
        self._landed.append(node)   # (deque appends are atomic: any thread)

    def let_go(self, node: Node) -> None:
        """(trio thread) Drops the held answers of ``node`` if nothing is pending on it, or
        if it has no name left (removed: the kernel dropped its entries then)."""
        if node.ino not in self._held or self._quiescent is None:
            return
        names = node.names()
        if names and not self._quiescent(node):
            return
        del self._held[node.ino]
        self.held_released += 1
        for d, name in names:
            for nodeid in [d.ino, *(d.kernel_ids or ())]:
                self._forgets.put((nodeid, name, False))
        self.forget_attrs(node)

    def held_state(self) -> dict:
        return {"on": self._hold_on and self._quiescent is not None and kernel_timeout > 0,
                "files": len(self._held), "released": self.held_released}

    async def run(self, quiescent: Callable[[Node], bool]) -> None:
        """The trio thread's part: every ``HOLD_POLL`` seconds while some file is held, what
        landed since is given its time to be let go (the kernel timeout from now, less two
        polls for this loop and the notification thread), and what is due is let go;
        nothing is done while no file is held."""
        self._quiescent = quiescent
        landed, leaving = self._landed, self._leaving
        while True:
            if not self._held:
                landed.clear()
                leaving.clear()
                self._some_held = trio.Event()
                await self._some_held.wait()
            await trio.sleep(HOLD_POLL)
            now = time.monotonic()
            due = now + max(0.0, kernel_timeout - 2 * HOLD_POLL)
            for _ in range(len(landed)):
                node = landed.popleft()
                if node.ino in self._held:
                    leaving.append((due, node))
            while leaving and leaving[0][0] <= now:
                self.let_go(leaving.popleft()[1])

    def forget_entry(self, parent_ino: int, name: bytes) -> None:
        """A name another node removed leaves the kernel's dentry cache at once, not after
        ATTR_TIMEOUT (Coherence.merge_listing); the file it named changed (its link count)."""
        attrtable.clear()
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
        attrtable.drop(parent_ino)   # its link count, for a directory
        until = self._missing.pop((parent_ino, name), None)
        if until is not None and until > time.monotonic():
            self._queued += 1
            self._forgets.put((parent_ino, name, True))

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
        attrtable.drop(node.ino)
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
                if isinstance(what, tuple) and what[2]:
                    self._sent += 1


def invalidate_attrs_now(ino: int) -> None:
    """The kernel forgets the attributes of the inode a request is about, before the reply
    (Loader.revalidated at open: the reader's first read must see the new size). Safe from a
    handler only for that inode: the kernel holds it for the request, so it is not being
    evicted."""
    attrtable.drop(ino)
    try:
        pyfuse3.invalidate_inode(ino, attr_only=True)
    except OSError:
        pass
