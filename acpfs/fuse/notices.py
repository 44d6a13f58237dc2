"""What the kernel may keep of this mount's answers, and what it is told to drop.

Owns the kernel timeout (how long the kernel may answer names and attributes from its own
caches: ``kernel_timeout``, set once by ``operations.make_operations``) and
``KernelCacheNotices``, the cache's notices to the kernel of changes another node made:
pyfuse3's invalidations, sent from a thread of their own, and the answers kept below Python
dropped with them (fuse/attrtable.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

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
                if isinstance(what, tuple):
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
