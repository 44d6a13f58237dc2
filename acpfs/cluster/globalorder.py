"""Global order across nodes (docs/design.md, "Global order across nodes"), where this
node's requests and its sequencer meet it.

The parts: the node records and the rule that says whether a change may land
(``peers.Peers``: this node's record, the others', ``cleared``, promises and the commit
wait's clock); the stamps and this node's frontier (``oplog.OpLog``); and here, what waits
on them: the sequencer's hold of the head op until the rule clears it (``hold``, with
``held`` for status), and the answer to a request that acknowledged a change, which waits
for the promise and the commit wait (``acknowledged``). Content acknowledged by a close
whose RELEASE does not come is queued by ``Core._queue_late_acks``.

Built by the daemon only where global order is on; ``None`` in its place means a node that
orders only its own changes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import trio

from ..errors import Aborted
from ..oplog.log import UNIT, OpLog
from ..oplog.ops import Op
from .peers import Peers
from .records import UP

log = logging.getLogger(__name__)


class GlobalOrder:
    def __init__(self, peers: Peers | Any, oplog: OpLog) -> None:
        self.peers = peers    # a Peers (or, in unit tests, a stand-in with cleared/kick/lease)
        self.oplog = oplog
        self.held: dict | None = None   # (oplog.lock) the op waiting for other nodes

    def status(self) -> dict:
        return self.peers.status(self.held)

    def clear(self, op: Op) -> bool:
        """Whether ``op``, queued behind ops applied but not yet popped (a group waiting for
        its fsync, flusher/groups.py), may land now without waiting (hold the op log's
        lock): cleared at its own stamp. Not at ``_stamp``: this node's frontier is still
        that of the ops before it, older than ``op``, and another node's change acknowledged
        in between would not hold it (a pointer landed before a paused node's shard). Its
        own stamp is never earlier than what ``hold`` will hold it to once it is the head,
        so what this clears, ``hold`` would too."""
        return self.peers.cleared(op.stamp) is True

    def _stamp(self, op: Op) -> float:
        """The stamp ``op`` is held to: see ``hold``."""
        return min(op.stamp, self.oplog.frontier()[0])

    def hold(self, op: Op, abort: threading.Event, meanwhile: Callable[[], None]) -> None:
        """The sequencer, before it applies ``op`` (hold the op log's lock): wait until no
        live node can still have to persist something it acknowledged before ``op``
        (``Peers.cleared``). ``meanwhile`` (later uploads) runs between two looks; ``abort``
        ends the wait (``Aborted``)."""
        peers = self.peers
        since = time.time()
        warned = False
        # Invariant (no waiting in a circle): a node's frontier is never behind the stamp
        # its head op is held to. Changes are queued in the order they were acknowledged
        # (Handles.flush), so the head holds the oldest stamp but (1) for a file written
        # through, queued at its RELEASE after a change made meanwhile, and (2) for a file
        # closed more than once before it was queued (a copy of its descriptor closed
        # first, as a shell's redirection does): its frontier is its first close, its
        # stamp the last. Either way the head waits only for what the other nodes
        # acknowledged before this node's oldest pending change (docs/design.md). Held to
        # its last close instead, two such files on two nodes waited for each other.
        stamp = self._stamp(op)
        while True:
            ok = peers.cleared(stamp)
            if ok is True:
                break
            if abort.is_set():
                raise Aborted()
            now = time.time()
            if getattr(peers, "held_blocks", None) is not None and peers.held_blocks(stamp):
                # a dead node's changes, held here in a replica, land first: the valve counts
                # from when they do (or their takeover fails: replicas.py)
                since = now
            if now - since > peers.lease:
                # a safety valve: the rule admits no circle, but a hold is never longer than
                # a lease, whatever holds it (docs/semantics.md, section 11)
                log.warning("global order: %s %r held for %.0f s, longer than the lease: it "
                            "goes on without waiting further", op.kind, op.path, now - since)
                break
            self.held = {"op": str(op.kind), "path": op.path, "since": since,
                         "waiting_for": None if ok is None else ok.record.label,
                         "instance": None if ok is None else ok.record.instance}
            if ok is not None and not warned and now - since > 10:
                warned = True
                r = ok.record
                # an idle record acknowledged nothing pending: its promise ran out, and it
                # has not been renewed since
                why = (f"which has not persisted what it acknowledged {now - r.frontier:.0f} s "
                       "ago" if r.state == UP else f"whose record (idle: nothing pending) has "
                       f"not been renewed for {now - r.heartbeat:.0f} s")
                log.warning("global order: %s %r has waited %.0f s for node %s (%s), %s; it "
                            "goes on once that node catches up, or after its lease (%.0f s) if "
                            "it stops renewing its record", op.kind, op.path, now - since,
                            r.label, r.instance, why, peers.lease)
            peers.kick()
            meanwhile()
            self.oplog.lock.wait(0.5)
        if self.held is not None:
            self.held = None
            if warned:
                log.warning("global order: %s %r goes on after %.1f s", op.kind, op.path,
                            time.time() - since)

    def acknowledges_at_once(self) -> bool:
        """Whether ``acknowledged`` would return at once for a change stamped from now on:
        no live peer (no commit wait), no promise of this node's record reaching past now
        (a stamp is taken from the clock, and not below the last: ``OpLog.next_stamp``), and
        no recovery under way (whose stamp is fixed). For a request answered without a
        coroutine (``AtOnce.flush``, fuse/atonce.py), asked before it stamps."""
        peers = self.peers
        with self.oplog.lock:
            return (self.oplog.recovery_stamp is None and peers.commit_until(time.time()) == 0.0
                    and peers.promised <= time.time())

    async def acknowledged(self) -> None:
        """A request that acknowledged a change (fs.acknowledges): answered once
        (1) the node's record no longer promises that nothing is pending under the change's
        stamp (``Peers.announce``; or that promise has run out), and (2) while other nodes
        are live, this node's clock is the tolerated skew past the stamp (commit wait), so
        that whatever another node does after the answer is stamped later, even by a clock
        that is behind."""
        peers = self.peers
        with self.oplog.lock:
            stamp = self.oplog.last_stamp
            until = peers.commit_until(stamp)
            promised = peers.promised
        if promised > stamp:
            # bounded by the promise itself: a backing that hangs costs at most that long
            with trio.move_on_at(trio.current_time() + promised + peers.skew - time.time()):
                await trio.to_thread.run_sync(peers.announce, abandon_on_cancel=True)
                promised = 0.0
            if promised:
                until = max(until, promised + peers.skew + UNIT)
        delay = until - time.time()
        if delay > 0:
            await trio.sleep(delay)
