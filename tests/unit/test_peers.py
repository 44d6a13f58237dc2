"""Global order across nodes, the protocol alone (acpfs/peers.py; contract 11), without mounts:
several ``Peers`` over one real records directory, each with a clock of its own, driven step
by step by a simulated cluster (``Cluster``) in simulated time.

The property, against a reference of what happened when: a change made on any node after a
change of another node was acknowledged (its request answered) is applied after it; and
every change is applied in the end (nobody waits for ever, also when the nodes' changes are
close together in time, which is where waiting on each other in a circle would show).
"""

from __future__ import annotations

import errno
import os
import random
import secrets
import threading
import time

import pytest
from faulty import FaultyBacking

from acpfs.backing.backing import NODES_DIR, Backing
from acpfs.oplog.log import UNIT, stamp_after
from acpfs.cluster.peers import Peers
from acpfs.cluster.records import RecordName, whole_us

SEEDS = int(os.environ.get("PEERS_SEEDS", "60"))


def test_record_names_round_trip():
    r = RecordName("0123456789ab", 7, 1795593897.322073, 1795593898.5, "up", "host.a:_ckpt")
    assert RecordName.parse(r.encode()) == r
    assert RecordName.parse(b"0123456789ab.7.1.2.gone.x") is None
    assert RecordName.parse(b"notes.txt") is None
    assert RecordName.parse(b"0123456789ab.x.1.2.up.x") is None


class SimNode:
    """One node: its clock (simulated time plus an offset), its queue of acknowledged changes
    (stamp, id), and its ``Peers`` over the shared records directory."""

    def __init__(self, cluster: "Cluster", root: str, offset: float, skew: float) -> None:
        self.cluster = cluster
        self.offset = offset
        self.lock = threading.Condition()
        self.last = 0.0
        self.queue: list[tuple[float, int]] = []
        self.peers = Peers(root, secrets.token_hex(6), "/ckpt", skew=skew, heartbeat=1.0,
                           lease=1e9, clock=self.clock, lock=self.lock, frontier=self.frontier)
        self.busy_until = 0.0          # its process waits for the answer to its last change

    def clock(self) -> float:
        return self.cluster.now + self.offset

    def stamp(self) -> float:
        self.last = stamp_after(self.clock(), self.last)     # as OpLog.next_stamp
        return self.last

    def frontier(self) -> tuple[float, bool]:
        if self.queue:
            return min(s for s, _ in self.queue), True
        return self.stamp(), False


class Cluster:
    def __init__(self, root: str, n: int, skew: float, spread: float, rnd: random.Random) -> None:
        self.now = 1000.0
        self.rnd = rnd
        self.nodes = [SimNode(self, root, rnd.uniform(-spread / 2, spread / 2), skew) for _ in range(n)]
        for node in self.nodes:
            node.peers.find_predecessor(None)
            node.peers.enter()
        for node in self.nodes:
            node.peers._list()
        self.answered: dict[int, float] = {}     # change id -> when its request was answered
        self.made: dict[int, tuple[int, float]] = {}   # change id -> (node, when it was made)
        self.applied: list[int] = []
        self.violations: list[str] = []
        self.next_id = 0

    def make(self, i: int) -> None:
        node = self.nodes[i]
        if self.now < node.busy_until:
            return
        cid = self.next_id = self.next_id + 1
        with node.lock:
            s = node.stamp()
            until = node.peers.commit_until(s)
            node.queue.append((s, cid))
            promised = node.peers.promised
        if promised > s and self.rnd.random() < 0.9:
            node.peers.announce()          # the record says "up" before the answer
        elif promised > s:
            until = max(until, promised + node.peers.skew + UNIT)   # the backing hung: promise runs out
        self.made[cid] = (i, self.now)
        # answered once the node's own clock passed ``until`` (commit wait)
        node.busy_until = self.answered[cid] = max(self.now, until - node.offset)

    def apply(self, i: int) -> bool:
        node = self.nodes[i]
        if not node.queue:
            return False
        s, cid = node.queue[0]
        with node.lock:
            ok = node.peers.cleared(s) is True
        if not ok:
            return False
        node.queue.pop(0)
        j, made = self.made[cid]
        for other, (k, _) in self.made.items():
            if k != j and self.answered[other] < made and other not in self.applied_set:
                self.violations.append(f"change {cid} of node {j} applied before change {other} "
                                       f"of node {k}, answered before {cid} was made")
        self.applied.append(cid)
        self.applied_set.add(cid)
        return True

    applied_set: set[int] = set()

    def step(self) -> None:
        r = self.rnd.random()
        i = self.rnd.randrange(len(self.nodes))
        node = self.nodes[i]
        if r < 0.3:
            self.make(i)
        elif r < 0.5:
            node.peers._publish()
        elif r < 0.7:
            node.peers._list()
        elif r < 0.9:
            self.apply(i)
        self.now += self.rnd.expovariate(1 / 0.004)

    def drain(self, limit: int = 20000) -> None:
        for _ in range(limit):
            if not any(n.queue for n in self.nodes):
                return
            for i, node in enumerate(self.nodes):
                while self.apply(i):
                    pass
                node.peers._publish()
            for node in self.nodes:
                node.peers._list()
            self.now += 0.01
        left = {i: n.queue[:3] for i, n in enumerate(self.nodes) if n.queue}
        raise AssertionError(f"the nodes wait for each other for ever: {left}")


@pytest.mark.parametrize("seed", range(SEEDS))
def test_changes_made_after_another_nodes_answer_are_applied_after_it(tmp_path, seed):
    rnd = random.Random(seed)
    skew = 0.01
    c = Cluster(str(tmp_path), rnd.randint(2, 4), skew, spread=skew, rnd=rnd)
    c.applied_set = set()
    for _ in range(400):
        c.step()
    c.drain()
    assert c.violations == [], c.violations[:3]
    assert sorted(c.applied) == sorted(c.made), "a change was never applied"


@pytest.mark.parametrize("seed", range(SEEDS // 2))
def test_changes_microseconds_apart_on_several_nodes_are_all_applied(tmp_path, seed):
    """Every change is applied in the end when the nodes' changes come within microseconds
    of each other (simultaneous saves). With stamps finer than a record's microseconds,
    293 of 300 seeds of this test ended with nodes waiting for each other."""
    rnd = random.Random(seed)
    c = Cluster(str(tmp_path), rnd.randint(2, 4), 0.0, spread=0.0, rnd=rnd)
    c.applied_set = set()
    for _ in range(300):
        r, i = rnd.random(), rnd.randrange(len(c.nodes))
        if r < 0.4:
            c.make(i)
        elif r < 0.55:
            c.nodes[i].peers._publish()
        elif r < 0.7:
            c.nodes[i].peers._list()
        else:
            c.apply(i)
        c.now += rnd.choice([0.0, 2e-7, 5e-7, 1e-6])
    c.drain()
    assert c.violations == [], c.violations[:3]
    assert sorted(c.applied) == sorted(c.made), "a change was never applied"


def test_changes_stamped_in_the_same_microsecond_on_two_nodes_do_not_wait_for_each_other(tmp_path):
    """Records carry microseconds. Stamps with finer digits were cut in the record, so two
    nodes whose oldest changes fell into one microsecond each read the other's frontier as
    older than its own stamp, and waited for each other (three nodes of the simultaneous
    first saves test did, until their leases ran out). Stamps are whole microseconds now."""
    c = Cluster(str(tmp_path), 2, 0.01, spread=0.0, rnd=random.Random(1))
    c.applied_set = set()
    a, b = c.nodes
    a.offset, b.offset = 0.2e-6, 0.7e-6
    c.now = 2000.0000001
    c.make(0)
    c.make(1)
    assert int(a.queue[0][0] * 1e6) == int(b.queue[0][0] * 1e6)   # the same microsecond
    c.drain()
    assert sorted(c.applied) == sorted(c.made) and c.violations == []


def test_stamps_are_whole_microseconds_and_survive_a_record_exactly():
    last = 0.0
    for now in (1795593897.3220734, 1795593897.3220734, 1795593897.3220736, 1795593897.9999999):
        s = stamp_after(now, last)
        assert s > last and round(s * 1e6) / 1e6 == s
        r = RecordName("0123456789ab", 1, s, now, "up", "h")
        assert RecordName.parse(r.encode()).frontier == s
        last = s


def test_clocks_further_apart_than_the_skew_can_break_the_order(tmp_path):
    """The guarantee rests on the skew bound: with clocks 20 skews apart, some seed shows a
    change applied before one answered earlier on a node whose clock is ahead."""
    broken = 0
    for seed in range(40):
        rnd = random.Random(seed)
        d = tmp_path / str(seed)
        d.mkdir()
        c = Cluster(str(d), 2, 0.001, spread=0.0, rnd=rnd)
        c.applied_set = set()
        c.nodes[0].offset, c.nodes[1].offset = 0.0, -0.02
        for _ in range(300):
            c.step()
        c.drain()
        broken += bool(c.violations)
    assert broken, "the order held even with clocks far apart: the check cannot fail"


def test_left_and_expired_peers_hold_nobody(tmp_path):
    rnd = random.Random(1)
    c = Cluster(str(tmp_path), 3, 0.01, spread=0.0, rnd=rnd)
    c.applied_set = set()
    a, b, d = c.nodes
    b.peers.lease = a.peers.lease = d.peers.lease = 5.0
    c.make(0)
    s, _ = a.queue[0]
    c.now += 0.1
    with a.lock:
        assert a.peers.cleared(s) is not True       # b and d have not written since
    b.peers._publish(leaving=True)                   # b unmounts
    c.now += 6                                       # d stops renewing: expired after 5 s
    a.peers._list()
    with a.lock:
        assert a.peers.cleared(s) is True
        states = {p.record.instance: p.record.state for p in a.peers.live()}
    assert states == {}, states
    names = os.listdir(tmp_path / os.fsdecode(NODES_DIR))
    assert len(names) == 3


def test_a_change_answered_under_a_promise_holds_the_other_nodes(tmp_path):
    """An idle node's record promises a frontier ahead of its clock; a change it acknowledges
    under that promise makes the record say "up" before the answer (announce), and another
    node trusts a promise only from a listing made after its own change."""
    c = Cluster(str(tmp_path), 2, 0.01, spread=0.0, rnd=random.Random(3))
    c.applied_set = set()
    a, b = c.nodes
    b.peers._publish()
    assert b.peers.promised > b.clock(), "an idle node with a live peer promises ahead"
    a.peers._list()
    c.now += 0.05
    c.make(1)                                       # B acknowledges X under its promise
    assert b.peers.mine.state == "up" and b.peers.promised == 0.0
    c.now = b.busy_until + 0.001
    c.make(0)                                       # A makes Y after X was answered
    (sy, _), (sx, _) = a.queue[0], b.queue[0]
    assert sy > sx
    with a.lock:
        assert a.peers.cleared(sy) is None, "a promise read before Y was made was trusted"
    a.peers._list()
    with a.lock:
        waits = a.peers.cleared(sy)
    assert waits is not True and waits.record.instance == b.peers.instance
    a.peers._publish()                              # A says Y is pending: X goes first
    b.peers._list()
    assert c.apply(1)
    b.peers._publish()
    c.now += 0.01
    a.peers._list()
    assert c.apply(0) and c.violations == []


def test_an_acknowledged_close_counts_in_the_frontier_until_it_is_applied(core):
    """close() stamps what it acknowledges (OpLog.note_ack); RELEASE queues it later. At every
    moment in between and until the op is applied, the node's frontier stays at or before the
    stamp (a node once showed "idle" between the two, and a pointer of another node landed
    before its shard)."""
    from harness import write_file
    cache = core.cache
    core.backing.inject("publish", hang=True)   # the op stays queued
    node = write_file(cache, b"shard", b"x" * 5000)
    cache.oplog.note_ack(node)
    stamp = cache.oplog.acked[node.ino][1]
    seen = []
    push = cache.oplog.push

    def checked(*a, **kw):
        with cache.oplog.lock:
            seen.append(cache.oplog.frontier())   # between the snapshot and the queue
        op = push(*a, **kw)
        with cache.oplog.lock:
            seen.append(cache.oplog.frontier())
        return op
    cache.oplog.push = checked
    cache.files.release(node, True)
    assert seen and all(pending and front <= stamp for front, pending in seen), seen
    core.backing.clear()
    core.drain()
    with cache.oplog.lock:
        front, pending = cache.oplog.frontier()
    assert not pending and front > stamp


def test_a_removed_record_or_records_directory_is_written_again(tmp_path):
    import shutil
    c = Cluster(str(tmp_path), 2, 0.01, spread=0.0, rnd=random.Random(5))
    a, b = c.nodes
    records = tmp_path / os.fsdecode(NODES_DIR)
    os.unlink(records / os.fsdecode(a.peers.mine.encode()))   # an operator removed it
    c.now += 0.5
    a.peers._publish()
    shutil.rmtree(records)                                      # the whole directory
    c.now += 0.5
    b.peers._publish()
    a.peers._publish()
    b.peers._list()
    with b.lock:
        assert [p.record.instance for p in b.peers.live()] == [a.peers.instance]
    assert len(os.listdir(records)) == 2


def test_a_daemon_restarted_on_the_same_cache_holds_nobody_for_its_dead_predecessor(tmp_path):
    """A daemon restarted at once must hold nobody, the protocol alone: a node's daemon dies
    idle and is restarted at once over the same cache directory. Its successor writes its own
    record, then marks the predecessor's "left": a change of another node that the dead record
    held goes on at that node's next listing. (The predecessor's record used to be removed, and
    a record missing from a listing is kept for a lease: here the lease is endless, so it was
    held for ever.)"""
    c = Cluster(str(tmp_path), 2, 0.01, spread=0.0, rnd=random.Random(7))
    a, b = c.nodes
    c.now += 0.5
    a.peers._publish()                     # idle, two heartbeats promised
    dead = a.peers.instance
    c.now += 5                             # a dies; its promise runs out
    stamp = b.stamp()
    c.now += 0.01
    b.peers._list()
    with b.lock:
        held = b.peers.cleared(stamp)
    assert held is not True and held.record.instance == dead
    successor = SimNode(c, str(tmp_path), a.offset, 0.01)      # same node, same clock
    assert successor.peers.find_predecessor(dead) == a.peers.mine.frontier
    successor.peers.enter()
    successor.peers.forget_predecessor(dead)
    c.nodes[0] = successor
    c.now += 0.01
    b.peers._list()
    with b.lock:
        assert b.peers.cleared(stamp) is True
        assert b.peers.peers[dead].record.state == "left"
    names = [RecordName.parse(os.fsencode(n)) for n in os.listdir(tmp_path / os.fsdecode(NODES_DIR))]
    assert sorted((r.instance, r.state) for r in names) == sorted(
        [(dead, "left"), (successor.peers.instance, "idle"), (b.peers.instance, "idle")])
    # the successor no longer ignores it: it removes it a minute later, as anyone does
    c.now += 61
    successor.peers._list()
    assert dead not in {RecordName.parse(os.fsencode(n)).instance
                        for n in os.listdir(tmp_path / os.fsdecode(NODES_DIR))}


class HoldRecorder:
    """Stands in for ``Peers`` in a flusher: clears every hold, noting the stamp held to."""
    lease = 30.0

    def __init__(self, held: list[float]) -> None:
        self.held = held

    def cleared(self, stamp: float) -> bool:
        self.held.append(stamp)
        return True

    def kick(self) -> None:
        pass


def test_a_change_queued_after_an_older_acknowledgement_waits_no_longer_than_it(make_core):
    """A file written through is queued at RELEASE; a change made between its close() and
    RELEASE is queued first. Its hold is then lowered to the older acknowledgement, so that
    this node's frontier is never behind the stamp its head is held to (no circle)."""
    from harness import write_file
    held: list[float] = []
    core = make_core(peers=HoldRecorder(held))
    cache = core.cache
    z = write_file(cache, b"z", b"z" * 100)
    cache.oplog.note_ack(z)                      # close() of z acknowledged, RELEASE not yet
    first = cache.oplog.acked[z.ino][0]
    cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    mkdir_stamp = cache.oplog.queue[-1].stamp
    cache.files.release(z, True)                 # z queued after the mkdir
    core.drain()
    assert mkdir_stamp > first
    assert held[0] == first, (held, first, mkdir_stamp)    # the mkdir, lowered to z's


def test_a_file_closed_twice_before_it_is_queued_is_held_to_its_first_close(make_core):
    """A shell's redirection closes a copy of the descriptor before the command writes: two
    acknowledgements, one op. The node's frontier is the first; the head is held to it, not
    to the last close. Held to the last, two such files on two nodes, their closes
    interleaved, each waited for the other's older frontier: a circle."""
    from harness import write_file
    held: list[float] = []
    core = make_core(peers=HoldRecorder(held))
    cache = core.cache
    z = write_file(cache, b"latest", b"step_5\n")
    cache.oplog.note_ack(z)                      # close(3) after dup2(3, 1)
    cache.oplog.note_ack(z)                      # the command's exit closes 1
    first, last = cache.oplog.acked[z.ino]
    cache.files.release(z, True)
    assert first < last and cache.oplog.queue[-1].stamp == last
    core.drain()
    assert held[0] == first, (held, first, last)


def test_a_record_of_another_user_holds_nobody(tmp_path, caplog):
    """Records planted by another user are ignored: the records directory is 1777. A record
    another user planted there (up, its frontier at the epoch, its heartbeat in 2100: it would
    never pass nor expire) is ignored with one WARNING naming the file and its owner; a record
    like it owned by root (this test's user) holds the change, so the check is by owner. Records
    are looked at once per file: a counted record renamed (renewed) is not looked at again."""
    c = Cluster(str(tmp_path), 1, 0.01, spread=0.0, rnd=random.Random(7))
    c.applied_set = set()
    (a,) = c.nodes
    records = tmp_path / os.fsdecode(NODES_DIR)
    assert oct(records.stat().st_mode & 0o7777) == "0o1777"
    planted = RecordName("0badc0ffee00", 1, 1e-6, 4102444800.0, "up", "evil")
    path = records / os.fsdecode(planted.encode())
    path.touch()
    os.chown(path, 65534, 65534)
    c.make(0)
    s, _ = a.queue[0]
    c.now += 0.1
    for _ in range(3):
        a.peers._list()
        with a.lock:
            assert a.peers.cleared(s) is True and a.peers.live() == []
    warned = [r.getMessage() for r in caplog.records if "ignoring the node record" in r.getMessage()]
    assert len(warned) == 1 and os.fsdecode(planted.encode()) in warned[0], warned
    assert "belongs to user nobody (uid 65534)" in warned[0]
    same = RecordName("0badc0ffee01", 1, 1e-6, 4102444800.0, "up", "root's")
    (records / os.fsdecode(same.encode())).touch()   # a record like it, of this node's user
    a.peers._list()
    with a.lock:
        held = a.peers.cleared(s)
    assert held is not True and held.record.instance == same.instance
    looked = []
    real_stat = os.stat

    def counting_stat(*args, **kw):
        looked.append(args[0])
        return real_stat(*args, **kw)
    renewed = RecordName(same.instance, 2, 1e-6, 4102444801.0, "up", "root's")
    os.rename(records / os.fsdecode(same.encode()), records / os.fsdecode(renewed.encode()))
    os.stat = counting_stat
    try:
        a.peers._list()
    finally:
        os.stat = real_stat
    assert looked == []
    with a.lock:
        assert a.peers.cleared(s).record.version == 2


# -- faults in the records' I/O, injected through the backing (tests/unit/faulty.py) ----------

def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def record_files(root) -> list[str]:
    return sorted(os.listdir(root / os.fsdecode(NODES_DIR)))


def warnings_with(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and text in r.getMessage()]


def test_a_failed_record_renewal_is_retried_and_said_once(tmp_path, caplog):
    """docs/faults.md, "the node records cannot be written or listed": a heartbeat whose
    rename fails does not stop the records thread. One WARNING says so, ``error`` (status)
    holds the error, listings go on, the renewal is tried again every heartbeat; once the
    backing takes it, the record is renewed and the error is gone."""
    back = FaultyBacking(str(tmp_path))
    p = Peers(back, secrets.token_hex(6), "/ckpt", heartbeat=0.05)
    p.find_predecessor(None)
    p.enter()
    first = p.mine
    fault = back.inject("replace_record", errno=errno.EIO)
    p.start()
    try:
        assert wait_for(lambda: fault.hits >= 3)                 # tried again and again
        listed = p.listed_at
        assert wait_for(lambda: p.listed_at > listed)            # the listing goes on
        assert p.thread.is_alive() and p.mine == first
        with p.lock:
            assert p.error.startswith("EIO: Input/output error")
        assert record_files(tmp_path) == [os.fsdecode(first.encode())]
        said = warnings_with(caplog, "(retrying)")
        assert len(said) == 1 and "EIO" in said[0], said
        renewal = f".acpfs-nodes/{os.fsdecode(first.encode())} -> .acpfs-nodes/{first.instance}."
        assert any(m == "replace_record" and path.startswith(renewal) for m, path in back.calls)
        back.clear()
        assert wait_for(lambda: p.mine.version > first.version and p.error is None)
        assert record_files(tmp_path) == [os.fsdecode(p.mine.encode())]
        assert len(warnings_with(caplog, "(retrying)")) == 1
    finally:
        back.clear()
        p.leave(drained=True)
    (left,) = [RecordName.parse(os.fsencode(n)) for n in record_files(tmp_path)]
    assert left.instance == p.instance and left.state == "left"
    back.close()


def test_a_record_that_cannot_be_created_at_mount_is_written_once_it_can(tmp_path):
    """The first record cannot be written (a read-only backing): ``enter`` raises (the daemon
    mounts anyway and says so, ``Daemon._records``); the records thread keeps trying, and
    writes it once the backing takes it. Until then no record of this node is there."""
    back = FaultyBacking(str(tmp_path))
    p = Peers(back, secrets.token_hex(6), "/ckpt", heartbeat=0.05)
    p.find_predecessor(None)
    fault = back.inject("create_record", errno=errno.EROFS)
    with pytest.raises(OSError) as raised:
        p.enter()
    assert raised.value.errno == errno.EROFS and p.mine is None
    p.start()
    try:
        assert wait_for(lambda: fault.hits >= 3)
        assert p.mine is None and record_files(tmp_path) == []
        with p.lock:
            assert p.error.startswith("EROFS: Read-only file system")
        back.clear()
        assert wait_for(lambda: p.mine is not None and p.error is None)
        assert record_files(tmp_path) == [os.fsdecode(p.mine.encode())]
    finally:
        back.clear()
        p.leave(drained=False)
    back.close()


def test_records_that_cannot_be_listed_hold_changes_for_a_lease_at_most(tmp_path, caplog):
    """docs/faults.md: while the records cannot be listed, this node's changes are held, for
    a lease at most, then go on without waiting for anyone (a WARNING says so), until a
    listing works again: then the peer that holds them counts again."""
    shift = [0.0]

    def clock() -> float:
        return time.time() + shift[0]
    oldest = whole_us(clock())
    other = Peers(str(tmp_path), secrets.token_hex(6), "/ckpt", heartbeat=0.05, lease=5.0,
                  clock=clock, frontier=lambda: (oldest, True))   # a change pending there
    other.find_predecessor(None)
    other.enter()
    back = FaultyBacking(str(tmp_path))
    p = Peers(back, secrets.token_hex(6), "/ckpt", heartbeat=0.05, lease=5.0, clock=clock,
              frontier=lambda: (whole_us(clock()), False))
    p.find_predecessor(None)
    assert p.enter() > 0                          # the other node is live
    with p.lock:
        assert p.cleared(stamp_after(clock(), oldest)).record.instance == other.instance
    fault = back.inject("list_records", errno=errno.EACCES)
    p.start()
    try:
        assert wait_for(lambda: fault.hits >= 2 and p.list_failing_since is not None)
        shift[0] += 1.0
        other._publish()                          # still live, still pending
        stamp = stamp_after(clock(), oldest)
        with p.lock:
            assert p.cleared(stamp) is None       # held: no listing started after it
        assert not warnings_with(caplog, "cannot be listed")
        shift[0] += 5.0                           # failing for more than the lease
        other._publish()
        with p.lock:
            assert p.cleared(stamp) is True       # goes on, unordered
        said = warnings_with(caplog, "cannot be listed for 5 s")
        assert len(said) == 1 and "EACCES" in said[0], said
        back.clear()
        assert wait_for(lambda: p.list_failing_since is None and p.listed_at > stamp)
        with p.lock:
            held = p.cleared(stamp)
        assert held is not True and held.record.instance == other.instance
    finally:
        back.clear()
        p.leave(drained=False)
        other.leave(drained=False)
    back.close()


def test_record_io_that_meets_a_stale_root_opens_the_root_again(tmp_path, monkeypatch):
    """A backing mounted again (NFS) answers ESTALE on the old root descriptor: the records'
    I/O opens the root again by path, as every other call on the backing does
    (``Backing.reopen``), and the listing succeeds in the same call."""
    back = Backing(str(tmp_path))
    p = Peers(back, secrets.token_hex(6), "/ckpt", heartbeat=0.05)
    p.find_predecessor(None)
    p.enter()
    old_root = back.root_fd
    real_open, real_fstat = os.open, os.fstat

    def stale_open(path, flags, *args, dir_fd=None, **kw):
        if dir_fd == old_root:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(path, flags, *args, dir_fd=dir_fd, **kw)

    def stale_fstat(fd):
        if fd == old_root:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_fstat(fd)
    monkeypatch.setattr(os, "open", stale_open)
    monkeypatch.setattr(os, "fstat", stale_fstat)
    p._list()
    monkeypatch.undo()
    assert back.reopened == 1 and back.root_fd != old_root
    assert p.listed_at > 0 and p.error is None
    p._publish()
    assert record_files(tmp_path) == [os.fsdecode(p.mine.encode())]
    p.leave(drained=True)
    back.close()
