"""Global order across nodes: this node's record in the backing, its peers' records, and the
rule that holds a change back until every live peer has persisted what it acknowledged before.

The guarantee (docs/semantics.md, "Order across nodes"): a change acknowledged on any node
at time T reaches the backing only after every other live node has persisted everything it
acknowledged before T, provided no two nodes' clocks differ by more than ``skew``.

How (docs/design.md, "Global order across nodes"):

- Every change gets a *stamp* when it is acknowledged: the node's clock, never going back
  (``OpLog.next_stamp``). A node's *frontier* is the stamp of its oldest acknowledged change not
  yet in the backing, or its clock when nothing is pending: everything it acknowledged
  before its frontier is durable.
- Each node keeps one record in ``<backing>/.acpfs-nodes/``. The record is an empty file
  whose *name* holds everything (``RecordName``), renamed to a new name to update it, so a
  node reads every peer's state with one listing of one directory, whatever the number of
  nodes. Names are listed by path, so an NFS client revalidates the directory (close-to-open).
- The sequencer applies a change stamped T only once ``cleared(T)``: a listing started after
  T - ``join_wait`` showed every live peer with a frontier past T (ties broken by instance).
  The oldest change of the whole cluster is always cleared, so the nodes never wait on each
  other in a circle.
- Commit wait: while peers are live, a request that acknowledged a change is answered only
  once this node's clock is ``skew`` past the change's stamp (``commit_until``). Then any
  change another node makes after that answer gets a larger stamp, even if its clock is up to
  ``skew`` behind: real-time order becomes stamp order.
- Joining: a node writes its record before it serves, then lists; if it saw live peers, it
  waits ``join_wait`` (two heartbeats) before serving, so that every peer has listed it
  before it acknowledges anything (they list at least once per ``heartbeat``).
- Liveness: a peer whose record's heartbeat is more than ``lease`` old is expired: it holds
  nobody back any more, and a WARNING names it. A node that unmounts after persisting
  everything renames its record to state "left", and nobody waits for it. So does a daemon
  restarted over the same cache directory, for its dead predecessor's record, once its own
  record covers what the predecessor acknowledged (``forget_predecessor``).
- Whose records count: only those of this daemon's user, of root, or of the owner the
  backing gives this daemon's own record; the others are ignored with a WARNING. That, the
  records' format and their I/O through ``Backing``: ``records`` (``RecordName``,
  ``RecordsDir``).

Cost: a node with nothing pending renames its record and lists the directory once per
``heartbeat`` each; while some node has changes pending, a node lists and renames at most
every ``poll`` seconds. ``ops`` counts them.

Threads: one thread of its own (``acpfs-peers``) does all I/O but the first, at mount (the
daemon gives that a bounded time, ``Daemon._records``), and ``announce``'s; ``cleared``,
``commit_until`` and ``status`` read its results under ``lock`` (the cache's lock, which the
sequencer waits on). Invariant: ``frontier`` is computed and the record renamed by that
thread only, so records of one instance carry increasing versions and non-decreasing
frontiers. The I/O itself goes through ``RecordsDir`` (``records``, with its own lock).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import Callable

from ..backing.backing import Backing
from ..oplog.log import UNIT
from ..config import DEFAULT_MAX_CLOCK_SKEW, DEFAULT_PEER_HEARTBEAT, DEFAULT_PEER_LEASE
from ..backing.retry import describe
from .records import IDLE, LEFT, UP, RecordName, RecordsDir, safe_label, whole_us

log = logging.getLogger(__name__)

FORGET_LEFT_AFTER = 60.0        # a "left" record is removed by anyone after this long
FORGET_DEAD_AFTER = 24 * 3600.0  # an expired record is removed by anyone after this long


@dataclasses.dataclass
class Peer:
    """What this node knows of another: its newest record, and when this node saw it."""
    record: RecordName
    listed: float               # this node's clock at the last listing that showed it
    expired: bool = False       # a WARNING was given; back to False when it renews


class Peers:
    """Global order for one daemon ``instance`` over ``backing``: the daemon's ``Backing``,
    or the backing directory's path (a ``Backing`` of its own is then opened at the first
    I/O, and closed at ``leave``)."""

    def __init__(self, backing: Backing | str, instance: str, mountpoint: str, *,
                 skew: float = DEFAULT_MAX_CLOCK_SKEW, heartbeat: float = DEFAULT_PEER_HEARTBEAT,
                 lease: float = DEFAULT_PEER_LEASE, clock: Callable[[], float] = time.time,
                 lock: threading.Condition | None = None,
                 frontier: Callable[[], tuple[float, bool]] | None = None) -> None:
        self.records = RecordsDir(backing)   # the records' I/O, and whose count
        self.root = self.records.root
        self.dir = self.records.dir          # for messages
        self.instance = instance
        self.label = safe_label(f"{socket.gethostname()}:{mountpoint}")
        self.address = ""   # HOST:PORT of this node's peer plane, in its record (set before enter)
        # the op log's lock (the sequencer waits on it), and this node's frontier
        # (``frontier()``, lock held: the frontier, and whether anything acknowledged is
        # pending; OpLog.frontier); without them, nothing is ever pending
        self.lock = lock if lock is not None else threading.Condition()
        self.frontier: Callable[[], tuple[float, bool]] = \
            frontier if frontier is not None else lambda: (self.clock(), False)
        self.skew = skew
        self.heartbeat = heartbeat
        self.lease = lease
        self.poll = heartbeat / 10       # while changes wait somewhere: list and renew this often
        self.join_wait = 2 * heartbeat   # every node lists at least once per heartbeat
        self.clock = clock
        # (lock) the thread's results
        self.peers: dict[str, Peer] = {}
        self.listed_at = 0.0         # start of the last complete listing (this node's clock)
        self.want = 0.0              # the sequencer waits for a listing started after this
        self.ops = 0                 # metadata operations on the backing, for status and tools
        self.error: str | None = None
        self.ignore: str | None = None   # the dead predecessor this daemon took over from
        self.mine: RecordName | None = None
        self._written = (0.0, -1.0, "")  # when, frontier, state of the last record written
        self._kept: set[str] = set()     # records this node may not remove (another user's)
        self.list_failing_since: float | None = None   # listings fail since (this clock)
        self._suspended = False          # (lock) changes go on unordered: records unreadable
        self.promise = 2 * heartbeat      # how far ahead an idle node's frontier is (_publish)
        self.promised = 0.0               # (lock) the frontier the record promises, if any
        self._wlock = threading.Lock()    # one record write at a time
        self._stop = threading.Event()
        self._kick = threading.Event()
        # replicas held for other nodes (cluster/replicas.py; set by the daemon): the oldest
        # change held for a node that may be dead, which this node's changes wait for too,
        # and what to do after each listing (drop replicas, take over a dead node's)
        self.held: Callable[[], float | None] = lambda: None
        self.on_listed: Callable[[], None] = lambda: None
        self.thread = threading.Thread(target=self._run, name="acpfs-peers", daemon=True)

    # -- joining and leaving (daemon thread) ----------------------------------------------
    def find_predecessor(self, predecessor: str | None) -> float | None:
        """Before a recovery: the frontier in the record of ``predecessor`` (the dead daemon
        on this cache directory, whose acknowledged changes this one replays), None if it
        left none. Its record is this daemon's to replace from now on."""
        self.records.ensure_dir()
        self.ignore = predecessor
        names = self.records.names(warn=False)   # also: the directory is one, and readable
        if predecessor is None:
            return None
        for name in names:
            r = RecordName.parse(name)
            if r is not None and r.instance == predecessor:
                log.info("taking over from the dead daemon %s of this node (its frontier %s)",
                         predecessor, time.strftime("%H:%M:%S", time.localtime(r.frontier)))
                return r.frontier
        return None

    def enter(self) -> float:
        """Write this node's first record, then list the peers. Returns how long to wait
        before serving: ``join_wait`` if other nodes are live, so that they have listed this
        one before it acknowledges anything."""
        self._publish(create=True)
        self.records.check_dir()
        self._list()
        with self.lock:
            live = self.live()
        if not live:
            return 0.0
        log.info("global order: %d other nodes share this backing (%s%s); waiting %.1f s for "
                 "them to see this one", len(live), ", ".join(p.record.label for p in live[:4]),
                 ", ..." if len(live) > 4 else "", self.join_wait)
        return self.join_wait

    # -- the records' I/O, through the backing ---------------------------------------------
    def backing(self) -> Backing:
        """The ``Backing`` the records are kept in (``RecordsDir.backing``)."""
        return self.records.backing()

    def forget_predecessor(self, predecessor: str) -> None:
        """This node's record now covers what ``predecessor`` (the dead daemon on this cache
        directory, whose journal this one replays) acknowledged: its record is renamed to say
        "left", so that every other node stops waiting for it at its next listing.

        Invariant: a predecessor's record says "left" only after this node's own record is
        written (``enter``), carrying the predecessor's frontier while its changes are
        replayed (``OpLog.recovery_stamp``). Removing the record instead was not enough: a
        node keeps a record missing from its listing for a lease (it may be in the middle of
        a rename), so the other nodes waited a whole lease for a daemon that a restart had
        replaced in under a second (systemd's ``Restart=on-failure`` after a SIGKILL held
        every other node 27 s). A record saying "left" is removed by anyone a minute later,
        this node included (it stops ignoring it here)."""
        try:
            names = self.records.names()
        except OSError as e:
            self._not_left(predecessor, e)
            return
        mine = sorted((r for r in map(RecordName.parse, names)
                       if r is not None and r.instance == predecessor), key=lambda r: r.version)
        if not mine:
            self.ignore = None     # no record: nothing to wait for
            return
        *older, last = mine
        left = dataclasses.replace(last, version=last.version + 1, heartbeat=self.clock(),
                                   state=LEFT)
        try:
            self.backing().replace_record(last.encode(), left.encode())
        except FileNotFoundError:
            pass                   # removed meanwhile (by an operator): nobody waits for it
        except OSError as e:
            self._not_left(predecessor, e)
            return
        with self.lock:
            self.ops += 1
        for r in older:            # a listing that crossed one of its renames
            self._remove(r)
        self.ignore = None
        log.info("global order: the record of the dead daemon %s now says it left; this "
                 "node's record covers what it acknowledged", predecessor)

    def _not_left(self, predecessor: str, e: OSError) -> None:
        log.warning("global order: cannot mark the record of the dead daemon %s in %s as left "
                    "(%s): the other nodes wait for it until its lease (%.0f s) runs out",
                    predecessor, self.dir, describe(e), self.lease)

    def start(self) -> None:
        self.thread.start()

    def leave(self, drained: bool) -> None:
        """Stop; once everything is persisted, say so, so that nobody waits for this node."""
        self._stop.set()
        self._kick.set()
        if self.thread.is_alive():
            self.thread.join(5)

        if drained:
            try:
                self._publish(leaving=True)
                log.info("left the nodes of %s: nobody waits for this node", self.dir)
            except OSError as e:
                log.warning("could not mark this node's record as left (%s): the other nodes "
                            "stop waiting for it after %.0f s", describe(e), self.lease)
        self.records.close()

    # -- asked by the sequencer and the FUSE thread (lock held) ----------------------------
    def live(self) -> list[Peer]:
        now = self.clock()
        return [p for p in self.peers.values()
                if p.record.state != LEFT and now - p.record.heartbeat <= self.lease]

    def serving(self) -> list[RecordName]:
        """The records of the live peers that serve a peer plane (an address in the record)."""
        return [p.record for p in self.live() if p.record.address]

    def cleared(self, stamp: float) -> Peer | None | bool:
        """True if a change stamped ``stamp`` may reach the backing now; otherwise the peer
        it waits for (None: a fresh enough listing of the peers)."""
        if self.listed_at <= stamp - self.join_wait:
            failing = self.list_failing_since
            if failing is not None and self.clock() - failing > self.lease:
                # the records cannot be read: no peer is known to wait for; this node's
                # changes are not held for ever (docs/faults.md)
                if not self._suspended:
                    self._suspended = True
                    log.warning("global order: the node records in %s cannot be listed for "
                                "%.0f s (%s): this node's changes go on without waiting for "
                                "other nodes until they can", self.dir, self.lease, self.error)
                return True
            self.want = max(self.want, stamp)
            return None
        self._suspended = False
        if self.held_blocks(stamp):   # a dead node's change, held here, lands first
            self.want = max(self.want, stamp)
            return None
        mine = (stamp, self.instance)
        for p in self.live():
            r = p.record
            if (r.frontier, r.instance) <= mine:
                self.want = max(self.want, stamp)
                return p
            if r.frontier > r.heartbeat and p.listed <= stamp:
                # a promise (see ``_publish``) covers what its node answered before it was
                # read: it must have been read after this change was made
                self.want = max(self.want, stamp)
                return None
        return True

    def held_blocks(self, stamp: float) -> bool:
        """(hold lock) Whether a change stamped ``stamp`` waits for a possibly dead node's
        changes held here in a replica (``held``)."""
        held = self.held()
        return held is not None and held <= stamp

    def commit_until(self, stamp: float) -> float:
        """When a request that acknowledged a change stamped ``stamp`` may be answered (0:
        at once; no live peer can order itself against it). A stamp is the clock cut to
        whole microseconds, so the wait is one unit longer than the skew: a change made
        anywhere after the answer is stamped strictly later, not in the same microsecond."""
        if not self.peers or not self.live():
            return 0.0
        return stamp + self.skew + UNIT

    def kick(self) -> None:
        """The frontier moved or the sequencer waits: write and list soon."""
        self._kick.set()

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        next_list = 0.0
        while not self._stop.is_set():
            now = self.clock()
            failed = False
            try:
                with self.lock:
                    front, pending = self.frontier()
                state = UP if pending else IDLE
                when, wfront, wstate = self._written
                # idle, the frontier is the clock: rewritten once per heartbeat only
                if now - when >= self.heartbeat or (now - when >= self.poll and (
                        state != wstate or (pending and front != wfront))):
                    self._publish()
            except Exception as e:   # a backing that refuses the record: listing goes on
                failed = self._failed(e)
            try:
                with self.lock:
                    want = self.want > self.listed_at
                if now >= next_list or (want and now - self.listed_at >= self.poll):
                    self._list()
                    self.list_failing_since = None
                    with self.lock:
                        waiting = [p for p in self.live() if p.record.state == UP]
                    # while other nodes have changes pending, look at them more often, and
                    # if one waits for this idle node's frontier, renew it at once
                    next_list = now + (self.poll if waiting else self.heartbeat)
                    if state == IDLE and any(p.record.frontier >= self._written[1] for p in waiting):
                        self._publish()
            except Exception as e:
                if self.list_failing_since is None:
                    self.list_failing_since = now
                failed = self._failed(e) or True
            if not failed:
                with self.lock:
                    self.error = None
            self._kick.wait(self.heartbeat if failed else self.poll)
            self._kick.clear()

    def _failed(self, e: Exception) -> bool:
        if not isinstance(e, OSError):   # a bug: said loudly; the records are kept up regardless
            log.exception("global order: renewing or reading the node records failed")
            return True
        with self.lock:
            first = self.error is None
            self.error = describe(e)
        if first:
            log.warning("global order: the node records in %s: %s (retrying)", self.dir,
                        describe(e))
        return True

    def _publish(self, create: bool = False, leaving: bool = False) -> None:
        """Write this node's record as it stands now.

        Promise: an idle node with live peers writes a frontier ``promise`` seconds ahead of
        its clock, so that peers need not wait for its next heartbeat. It keeps its word in
        ``announce``: a change acknowledged with a stamp under the promise is answered only
        after the record says "up" again (or once the promise has run out). ``promised`` is
        set under the lock together with the frontier, so that a change stamped after it
        sees it (``GlobalOrder.acknowledged``)."""
        with self._wlock:
            with self.lock:
                front, pending = self.frontier()
                if leaving:
                    state = LEFT
                elif pending:
                    state = UP
                else:
                    state = IDLE
                    if self.live():
                        front = whole_us(front + self.promise)
                self.promised = front if state == IDLE and front > self.clock() else 0.0
            self._write(front, state, create)

    def announce(self) -> None:
        """(A worker thread, for a request that acknowledged a change) If the change is
        pending under this node's promise, make the record say "up" before the answer."""
        with self.lock:
            front, pending = self.frontier()
            if not pending or front >= self.promised:
                return
        self._publish()

    def _write(self, front: float, state: str, create: bool = False) -> None:
        now = self.clock()
        old = self.mine
        new = RecordName(self.instance, old.version + 1 if old else 1, front, now, state, self.label,
                         self.address)
        name = new.encode()
        back = self.backing()
        if old is not None and not create:
            try:
                back.replace_record(old.encode(), name)
            except FileNotFoundError:
                # removed by someone (an operator; another node after a long pause): again
                log.warning("global order: this node's record in %s was removed; writing it "
                            "again", self.dir)
                create = True
        if old is None or create:
            self.records.create(name)
        with self.lock:
            self.ops += 1
            self.mine = new
        self._written = (now, front, state)
        log.debug("record: %s, frontier %+.3f s", state, front - now)

    def _list(self) -> None:
        started = self.clock()
        names = self.records.names()
        found: dict[str, RecordName] = {}
        for name in names:
            r = RecordName.parse(name)
            if r is None or r.instance in (self.instance, self.ignore):
                continue
            # a listing that crosses a rename may show a record twice: the newer one counts
            if r.instance not in found or r.version > found[r.instance].version:
                found[r.instance] = r
        stale: list[RecordName] = []
        with self.lock:
            self.ops += 1
            for inst, r in found.items():
                p = self.peers.get(inst)
                if p is None:
                    self.peers[inst] = p = Peer(r, started)
                    if r.state != LEFT and started - r.heartbeat <= self.lease:
                        log.info("global order: node %s (%s) shares this backing", r.label, inst)
                elif r.version >= p.record.version:
                    p.record, p.listed = r, started
            # A record missing from one listing may be in the middle of a rename: it is kept
            # until it has been missing for a lease (removed by an operator, or forgotten).
            for inst, p in list(self.peers.items()):
                if inst not in found and started - p.listed > self.lease:
                    del self.peers[inst]
            for p in self.peers.values():
                age = started - p.record.heartbeat
                if p.record.state == LEFT:
                    if age > FORGET_LEFT_AFTER:
                        stale.append(p.record)
                    continue
                if age > self.lease and not p.expired:
                    p.expired = True
                    log.warning("global order: node %s (%s) has not renewed its record for "
                                "%.0f s (lease %.0f s): no longer waiting for it; changes "
                                "made here from now on may reach the backing before what it "
                                "acknowledged", p.record.label, p.record.instance, age, self.lease)
                elif age <= self.lease and p.expired:
                    p.expired = False
                    log.warning("global order: node %s (%s) is back; waiting for it again",
                                p.record.label, p.record.instance)
                if age > FORGET_DEAD_AFTER:
                    stale.append(p.record)
            self.listed_at = started
            self.lock.notify_all()
        for r in stale:
            if r.instance not in self._kept:
                self._remove(r)
        self.on_listed()

    def _remove(self, r: RecordName) -> None:
        try:
            removed = self.backing().remove_record(r.encode())
        except OSError as e:   # another user's, in the sticky directory: left as it is
            log.debug("could not remove the record of %s: %s", r.instance, describe(e))
            self._kept.add(r.instance)
            return
        if removed:
            log.info("global order: removed the record of node %s (%s, %s)", r.label,
                     r.instance, r.state)
        with self.lock:
            self.ops += 1
            self.peers.pop(r.instance, None)

    # -- status (lock held) ---------------------------------------------------------------
    def status(self, held: dict | None) -> dict:
        now = self.clock()
        peers = []
        for p in sorted(self.peers.values(), key=lambda p: p.record.label):
            r = p.record
            age = now - r.heartbeat
            state = r.state if r.state == LEFT else ("expired" if age > self.lease else r.state)
            peers.append({"node": r.label, "instance": r.instance, "state": state,
                          "address": r.address or None,
                          "frontier_lag": round(max(0.0, now - r.frontier), 3),
                          "last_heartbeat": round(age, 3),
                          "frontier": r.frontier, "listed": p.listed})
        return {"instance": self.instance, "node": self.label, "skew": self.skew,
                "heartbeat": self.heartbeat, "lease": self.lease, "ops": self.ops,
                "error": self.error, "held": held, "peers": peers, "listed_at": self.listed_at}
