"""The op log: the ordered stream of the mount's mutations, from the request that makes one
to the sequencer that applies it to the backing.

Owns:
- ``lock``: the one lock of the cache, the flusher and global order (a ``Condition``: the
  sequencer and the records thread wait on it). Fields marked (lock) here and in the
  modules that hold the op log are read and written with it held (docs/concurrency.md).
- the sequence numbers: ``seq``, the last one given; ``applied_seq``, the last op applied
  to the backing. Ordering invariant: ops are applied in seq order, so the backing always
  shows a state of the mount's history.
- the queue of ops not applied yet, each node's queued publishes (``Node.publish_ops``) and
  their bytes, and the staged files the flusher is to remove (``discards``).
- the stamps of global order (peers.py): ``next_stamp``, the content close() acknowledged
  that is not queued yet (``acked``), the stamp of replayed changes (``recovery_stamp``),
  and this node's ``frontier``.
- the journal (journal.py): a record per op, the record of each file dirty or closed but
  not queued yet (``journaled``), and the cut-back once everything in it is applied.

Who calls what: the cache queues (``push``), stamps and journals file states on the FUSE
thread; the flusher's sequencer takes applied ops off the head (``pop``, then ``applied``);
peers reads ``frontier``. Nothing here does I/O but journal appends.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import threading
import time
from typing import Any

from ..store.api import Content, Store
from .journal import CLEAN, DIRTY, FLUSHED, Journal, Record
from .ops import Op, Publish, content_record
from ..node import JournalState, Node, OpKind, OpState, Staged, mount_path, node_path


def stamp_after(now: float, last: float) -> float:
    """A stamp: ``now`` in whole microseconds, later than ``last``.

    Invariant: stamps and frontiers are whole microseconds, the unit of a record, so a
    frontier read from a record compares with the stamps of its node exactly. (They were
    cut to microseconds in the record only: two nodes whose oldest changes fell into the
    same microsecond each saw the other's frontier before its own stamp, and waited for
    each other.)"""
    return max(int(now * 1e6), round(last * 1e6) + 1) / 1e6


UNIT = 1e-6   # a stamp's unit: a stamp is at most this much before the moment it was taken


class OpLog:
    def __init__(self, store: Store, journal: Journal | None = None, applied_seq: int = 0) -> None:
        self.store = store          # block references of content records
        self.journal = journal      # None: unit tests without one
        self.lock = threading.Condition()
        self.seq = applied_seq      # the last seq given (a recovery goes on from the dead one's)
        self.applied_seq = applied_seq   # the last seq applied: written by the sequencer only
        self.queue: collections.deque[Op] = collections.deque()   # (lock)
        self.queued_bytes = 0                                    # (lock) of queued publishes
        self.queued_total_files = 0   # (lock) publishes queued since mount: files closed with
        self.queued_total_bytes = 0   # changes (or persisted while open), and their sizes
        self.discards: list[Staged] = []   # (lock) staged files to remove (Flusher._launch)
        self.journaled: set[Node] = set()  # nodes whose journal_state is not NONE
        # Global order. Stamps: this node's clock when a change was acknowledged, never
        # going back (next_stamp). ``acked``: files whose close() acknowledged content that
        # RELEASE has not queued yet, ino -> (first, last) stamp. While a recovery replays a
        # dead daemon's changes, they carry ``recovery_stamp`` (its frontier).
        self.last_stamp = 0.0                              # (lock)
        self.acked: dict[int, tuple[float, float]] = {}    # (lock)
        self.recovery_stamp: float | None = None
        self._floors: list[tuple[float, int]] = []   # (lock) heap of (floor, seq) of queued ops
        # --replicas: gets every journal record, cut-back and applied op (cluster/replicate.py;
        # set before the first change, by the daemon)
        self.mirror: Any = None

    # -- stamps (global order) -------------------------------------------------------------
    def next_stamp(self) -> float:
        """A stamp later than every one given before (hold lock)."""
        if self.recovery_stamp is not None:
            return self.recovery_stamp
        s = self.last_stamp = stamp_after(time.time(), self.last_stamp)
        return s

    def note_ack(self, node: Node) -> None:
        """close() acknowledges the content of ``node``: stamp it now; RELEASE queues it."""
        with self.lock:
            s = self.next_stamp()
            first = self.acked.get(node.ino, (s, s))[0]
            self.acked[node.ino] = (first, s)

    def frontier(self) -> tuple[float, bool]:
        """This node's frontier (hold lock): the stamp of its oldest acknowledged change not in
        the backing yet, and True; or, with nothing pending, a stamp later than every change
        acknowledged so far (its clock), and False."""
        floors = self._floors
        while floors and floors[0][1] <= self.applied_seq:
            heapq.heappop(floors)
        lows = [floors[0][0]] if floors else []
        if self.acked:
            lows.append(min(first for first, _ in self.acked.values()))
        if self.recovery_stamp is not None:
            lows.append(self.recovery_stamp)
        if lows:
            return min(lows), True
        return self.next_stamp(), False

    # -- the queue ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The op log's part of the status document (docs/status.md): the queue, what it
        holds to flush, what was queued since the mount, the journal's error, and when the
        oldest queued op was queued (``head_since``, None when the queue is empty)."""
        with self.lock:
            queue = self.queue
            files = len({op.node.ino for op in queue
                         if op.kind == OpKind.PUBLISH and op.state != OpState.VOID})
            return {"queue": {"pending_ops": len(queue), "applied_seq": self.applied_seq,
                              "last_seq": self.seq},
                    "flushing": {"files": files, "bytes": self.queued_bytes},
                    "queued_since_mount": {"files": self.queued_total_files,
                                           "bytes": self.queued_total_bytes},
                    "journal_error": self.journal.error if self.journal is not None else None,
                    "head_since": queue[0].since if queue else None}

    def push(self, op: Op, stamp: tuple[float, float] = (0.0, 0.0)) -> Op:
        """Queue one mutation, journaled first (``stamp``: (stamp, floor) of a change close()
        acknowledged earlier, else it is stamped here)."""
        self.seq += 1
        op.seq = self.seq
        where = op.where()
        op.path = os.fsdecode(where) if where else node_path(op.node)
        op.stamp, op.floor = stamp
        op.node.last_seq = self.seq
        for d in op.others():
            d.last_seq = self.seq
        contents: list = []   # the content the record names, for the mirror

        def refs(c: Content) -> list[int]:
            contents.append(c)
            return self.store.ref(c)
        record = op.record(refs) if self.journal is not None else None
        with self.lock:
            if not op.stamp:
                op.stamp = op.floor = self.next_stamp()
            if record is not None:   # the journal holds records in seq order
                self._journal(record, contents[0] if contents else None, op.floor or op.stamp)
            heapq.heappush(self._floors, (op.floor or op.stamp, op.seq))
            self.queue.append(op)
            if isinstance(op, Publish):
                self.acked.pop(op.node.ino, None)   # what close() acknowledged: in op now
                op.node.publish_ops.append(op)
                self.queued_bytes += op.nbytes
                self.queued_total_files += 1
                self.queued_total_bytes += op.nbytes
                sp = op.snap.staged
                if sp is not None:
                    op.dir_fd, op.temp_name = sp.dir_fd, sp.name
            self.lock.notify_all()
        return op

    def void_last(self, node: Node) -> None:
        """``node`` leaves the namespace and the op that removes it is queued next: its last
        snapshot, if it is the newest op and not applied yet, is skipped (Files.cancel)."""
        if node.publish_ops:
            last = node.publish_ops[-1]
            with self.lock:
                if last.seq == self.seq and last.state in (OpState.QUEUED, OpState.UPLOADING):
                    last.state = OpState.VOID

    def discard(self, sp: Staged) -> None:
        """Have the flusher remove a staged file no op will publish (hold lock or not)."""
        with self.lock:
            self.discards.append(sp)
            self.lock.notify_all()

    def head_error(self, node: Node) -> str | None:
        """The error of the op at the head of the queue if it is ``node``'s (ops but
        publishes fail only there; a publish's error is on the op in ``publish_ops``)."""
        with self.lock:
            head = self.queue[0] if self.queue else None
            return head.error if head is not None and head.node is node else None

    def failing_op(self, within: int) -> Op | None:
        """The first op of the ``within`` at the head of the queue whose last attempt failed."""
        with self.lock:
            for op in itertools.islice(self.queue, 0, within):
                if op.error:
                    return op
        return None

    def pop(self, op: Op) -> None:
        """The sequencer applied ``op``, the head (hold lock): off the queue and its node.
        Then, once the flusher's own bookkeeping is done, ``applied``."""
        self.queue.popleft()
        if self.journal is not None:
            # before the flusher drops the block references (journal.py, invariants)
            self.journal.applied(op.seq, idle=not self.queue)
        if self.mirror is not None:
            self.mirror.applied(op.seq)
            if not self.queue:   # all of it in the backing: the copy is cut back at once
                self.mirror.reset()
                for n in self.journaled:
                    self.mirror.add(*self._state(n))
        if isinstance(op, Publish):
            op.node.publish_ops.remove(op)
            self.queued_bytes -= op.nbytes

    def applied(self, op: Op) -> None:
        """(hold lock) Invariant: applied_seq moves only after the flusher's bookkeeping of
        ``op``. Waiters read it without the lock (WriteThrough.wait_seq, from the trio
        thread) and then rely on that bookkeeping: a published staged file detached from
        its node, the node evictable. Set before it, a writer opening the file in that
        window kept the queued staged file, which the bookkeeping then took away."""
        self.applied_seq = op.seq
        self.lock.notify_all()

    # -- the journal (see journal.py) --------------------------------------------------------
    def journal_state(self, node: Node, state: JournalState, content: Content = None,
                      record: bool = True) -> None:
        """Move ``node`` to journal state ``state``, writing the record that says so."""
        with self.lock:
            if node.journal_state == JournalState.FLUSHED and node.journal_content is not None:
                self.store.drop(node.journal_content)
            node.journal_content = None
            node.journal_state = state
            if state == JournalState.FLUSHED:
                node.journal_content = content
            if state == JournalState.NONE:
                self.journaled.discard(node)
            else:
                self.journaled.add(node)
            if record and self.journal is not None:
                self._journal(*self._state(node))

    def rejournal(self, node: Node) -> None:
        """A journaled file lost the name its record gives: say it again under its first name."""
        if node.journal_state != JournalState.NONE and self.journal is not None:
            with self.lock:
                self._journal(*self._state(node))

    def _journal(self, record: Record, content: Content = None, stamp: float = 0.0) -> None:
        """Append ``record`` (hold lock), cutting the journal back first if it is idle; the
        mirror (``--replicas``: cluster/replicate.py) gets the same, with the content the
        record names and the stamp of the change."""
        assert self.journal is not None
        self.journal.append(record, self._live_records)
        if self.mirror is not None:   # cut back with the journal: when ``pop`` empties the queue
            self.mirror.add(record, content, stamp)

    def _state(self, node: Node) -> tuple[Record, Content, float]:
        """A file's state record, the content it names and the stamp of its close."""
        if node.journal_state != JournalState.FLUSHED:
            return self._state_record(node), None, 0.0
        first = self.acked.get(node.ino)
        return self._state_record(node), node.journal_content, \
            first[0] if first is not None else self.last_stamp

    def _live_records(self) -> list[Record]:
        return [self._state_record(n) for n in self.journaled]

    def _state_record(self, node: Node) -> Record:
        if node.journal_state == JournalState.DIRTY:
            return Record(0, DIRTY, node.ino, mount_path(node))
        if node.journal_state == JournalState.FLUSHED:
            content = node.journal_content
            return content_record(0, FLUSHED, node, node, [] if content is None else
                                  self.store.ref(content), (node.atime, node.mtime),
                                  dict(node.xattrs or {}))
        return Record(0, CLEAN, node.ino)
