"""Replicas (cluster/replicate.py, cluster/replicas.py) in process: the copy another node
holds of a daemon's journal is recovered as the journal itself would be, whatever the
batches, and the holder keeps its budget."""

from __future__ import annotations

import io
import random
import time
from pathlib import Path

import pytest

from acpfs.cluster.replicas import Replicas
from acpfs.cluster.replicate import Replicator
from test_recovery import Restarted, check_backing, killed_daemon


class Loopback:
    """The plane between a Replicator and a Replicas, in process: each batch is cut at a
    random point of its body (a connection lost halfway) now and then."""

    def __init__(self, holder: Replicas, rng: random.Random) -> None:
        self.holder, self.rng = holder, rng
        self.batches = 0
        self.cuts = 0

    def replicate(self, address, origin, first, body, length):
        data = b"".join(body)
        assert len(data) == length
        self.batches += 1
        if self.batches == 1 or self.rng.random() < 0.3:   # cut short: the holder stops
            self.cuts += 1                                   # at an entry it lacks
            data = data[:self.rng.randrange(len(data) + 1)]
            try:
                return self.holder.receive(origin, first, io.BytesIO(data), length)
            except EOFError:
                return self.holder.held[origin].next, "cut"
        return self.holder.receive(origin, first, io.BytesIO(data), length)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_replica_is_recovered_as_the_journal_would_be(tmp_path, make_core, seed):
    """The changes of test_recovery's killed daemon (every kind of op, a close without its
    RELEASE, a file open at the crash, a file created and deleted), copied in batches of
    which some are cut short, are recovered from the copy alone as from the journal."""
    rng = random.Random(seed)
    holder = Replicas(str(tmp_path / "held"), 1 << 30, [])
    made: list[Replicator] = []

    def attach(core) -> None:
        r = Replicator(core.store, Loopback(holder, rng), core.backing.instance,
                       lambda: [("b0b0b0b0b0b0", "loop:1")])
        core.oplog.mirror = r
        r.start()
        made.append(r)
    c = killed_daemon(tmp_path, make_core, before=attach)
    r = made[0]
    deadline = time.monotonic() + 20
    while not r.copied(r.position()):
        assert time.monotonic() < deadline, r.status()
        time.sleep(0.01)
    assert r.status()["owed_records"] == 0
    assert r.remote.cuts >= 1 and r.remote.batches > r.remote.cuts
    r.stop()
    h = holder.held[c.backing.instance]
    h.write_cache_dir()
    # another node recovers the copy; the dead daemon's own cache directory plays no part
    rr = Restarted(c.back, Path(h.dir))
    try:
        report = rr.recover()
        rr.drain()
        assert report.lost_open_files == ["o"] and report.files == 4, report
        check_backing(c.back)
    finally:
        rr.close()


def test_the_budget_is_kept_and_a_gap_is_refused(tmp_path):
    from acpfs.cluster.replicas import ENTRY, RECORD, RESET
    from acpfs.oplog.journal import Record
    holder = Replicas(str(tmp_path / "held"), 1000, [])
    rec = Record(1, "publish", 5, b"f", size=600)

    def batch(*entries):
        return b"".join(ENTRY.pack(k, 1.0, len(p), len(c), 0) + p + c for k, p, c in entries)
    body = batch((RESET, b"", b""), (RECORD, rec.encode(), b"x" * 600))
    assert holder.receive("ab12", 1, io.BytesIO(body), len(body)) == (3, "")
    assert holder.status()["held_bytes"] == 600
    rec2 = Record(2, "publish", 6, b"g", size=600)
    body = batch((RECORD, rec2.encode(), b"y" * 600))
    nxt, why = holder.receive("ab12", 3, io.BytesIO(body), len(body))
    assert nxt == 3 and "budget is full" in why and holder.status()["refused_batches"] == 1
    assert holder.status()["held_bytes"] == 600
    nxt, why = holder.receive("ab12", 7, io.BytesIO(body), len(body))   # entries 3-6 missing
    assert nxt == 3 and "expected" in why
    # a RESET starts over anywhere, and frees what was held
    body = batch((RESET, b"", b""))
    assert holder.receive("ab12", 9, io.BytesIO(body), len(body)) == (10, "")
    assert holder.status()["held_bytes"] == 0
    assert not list((tmp_path / "held" / "ab12" / "files").iterdir())
