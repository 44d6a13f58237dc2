"""Publishes into one directory share its fsync (acpfs/flusher/groups.py), on a core without a
mount: fewer directory fsyncs than files, nothing counted applied (``applied_seq``, the
journal, ``acpfs sync``) before the fsync that makes it durable, and a group that never
spans two directories or an op of another kind."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import Parts, write_file


def wait_for(cond, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def dir_fsyncs(back, path: str) -> int:
    return sum(1 for method, p in list(back.calls) if method == "fsync" and p == path)


def publish_all(cache, parent, names, data=b"x" * 100):
    for name in names:
        node = write_file(cache, name, data, parent)
        cache.files.release(node, True)


def test_a_group_lands_with_one_fsync_and_counts_as_applied_only_after_it(core):
    cache, back, oplog = core.cache, core.backing, core.oplog
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    core.drain()
    before = oplog.applied_seq
    held = back.inject("fsync", path="d", hang=True)   # the group's fsync of d, held
    publish_all(cache, d, [b"f%02d" % i for i in range(40)])
    wait_for(held.entered.is_set, "no directory fsync")
    renamed = [n for n in os.listdir(core.back / "d") if n.startswith("f")]
    assert renamed                                      # the renames are made
    time.sleep(0.2)             # meanwhile the uploads under way finish: the next group's
    assert oplog.applied_seq == before                  # none of them counts yet
    assert len(oplog.queue) == 40
    back.clear()
    core.drain()
    assert sorted(n for n in os.listdir(core.back / "d") if not n.startswith(".")) == \
        [f"f{i:02d}" for i in range(40)]
    syncs = dir_fsyncs(back, "d")
    grouped = core.flusher.status()["grouped_publishes"]
    assert 1 <= syncs < 40 and grouped["directory_fsyncs"] == syncs
    assert grouped["files"] >= 2


def test_a_group_ends_at_another_directory_and_at_another_kind_of_op(core):
    """z/x0, then d/a1 d/a2 e/b1 d/a3 (mkdir d/sub) d/a4, all uploaded before the sequencer
    lands anything: with d's fsync held, e/b1 is not renamed (it waits for d's group to be
    durable), nor anything after it."""
    cache, back, oplog = core.cache, core.backing, core.oplog
    root = cache.inodes.root
    dirs = {name: cache.names.mkdir(root, name, 0o755, 0, 0) for name in (b"d", b"e", b"z")}
    core.drain()
    first = back.inject("create_temp", path="z/", hang=True)   # the sequencer waits for x0
    publish_all(cache, dirs[b"z"], [b"x0"])
    wait_for(first.entered.is_set, "x0 not uploading")
    held = back.inject("fsync", path="d", hang=True, times=1)
    publish_all(cache, dirs[b"d"], [b"a1", b"a2"])
    publish_all(cache, dirs[b"e"], [b"b1"])
    publish_all(cache, dirs[b"d"], [b"a3"])
    cache.names.mkdir(dirs[b"d"], b"sub", 0o755, 0, 0)
    publish_all(cache, dirs[b"d"], [b"a4"])
    last = oplog.seq
    wait_for(lambda: sum(1 for m, _ in list(back.calls) if m == "finish_temp") >= 5,
             "the others are not uploaded meanwhile")
    first.release()
    wait_for(held.entered.is_set, "no fsync of d")
    time.sleep(0.2)
    assert os.path.exists(core.back / "d" / "a1")
    assert not os.path.exists(core.back / "e" / "b1")   # the next directory waits
    assert not os.path.exists(core.back / "d" / "a3")
    held.release()
    core.drain(last)
    for path in ("z/x0", "d/a1", "d/a2", "e/b1", "d/a3", "d/sub", "d/a4"):
        assert os.path.exists(core.back / path), path


def test_a_failing_fsync_keeps_the_group_and_is_retried(core):
    cache, back, oplog = core.cache, core.backing, core.oplog
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    core.drain()
    before = oplog.applied_seq
    fault = back.inject("fsync", path="d", errno=errno.EIO, times=3)
    publish_all(cache, d, [b"f%d" % i for i in range(10)])
    wait_for(lambda: fault.hits >= 1, "no fsync failed")
    wait_for(lambda: oplog.queue and oplog.queue[0].error is not None or fault.hits >= 3,
             "the failure is not shown")
    assert oplog.applied_seq == before or fault.hits >= 3
    core.drain()
    assert fault.hits == 3 and oplog.applied_seq == oplog.seq
    assert core.flusher.status()["errors_since_mount"]["retries"] >= 3


class PausedNode:
    """Stands in for ``Peers``: another node that acknowledged a change at ``frontier`` and
    has not persisted it (paused): a change stamped at or after it is not cleared."""
    lease = 30.0

    def __init__(self) -> None:
        self.frontier = float("inf")

    def cleared(self, stamp: float) -> bool | None:
        return True if stamp < self.frontier else None

    def kick(self) -> None:
        pass


def test_a_publish_never_joins_a_group_past_another_nodes_frontier(make_core):
    """d/shard_a is closed, then (on a paused node) shard_b, then d/.metadata here; both files
    are uploaded before the sequencer lands shard_a. shard_a may land (nothing of the other
    node is older), and opens a group; .metadata, into the same directory and uploaded, must
    not join it: this node's frontier is shard_a's (still queued until the group's fsync), so
    holding .metadata to that frontier let it land before shard_b (seen in CI:
    test_global_order.py::test_pointer_never_lands_before_a_paused_nodes_shard)."""
    paused = PausedNode()
    core = make_core(peers=paused)
    cache, back, oplog = core.cache, core.backing, core.oplog
    root = cache.inodes.root
    z = cache.names.mkdir(root, b"z", 0o755, 0, 0)
    d = cache.names.mkdir(root, b"d", 0o755, 0, 0)
    core.drain()
    first = back.inject("create_temp", path="z/", hang=True)   # the sequencer waits for x0
    publish_all(cache, z, [b"x0"])
    wait_for(first.entered.is_set, "x0 not uploading")
    publish_all(cache, d, [b"shard_a"])
    paused.frontier = oplog.next_stamp()   # the other node's shard_b: closed, not persisted
    publish_all(cache, d, [b".metadata"])
    last = oplog.seq
    wait_for(lambda: sum(1 for m, _ in list(back.calls) if m == "finish_temp") >= 2,
             "shard_a and .metadata are not uploaded meanwhile")
    first.release()
    wait_for(lambda: os.path.exists(core.back / "d" / "shard_a"), "shard_a did not land")
    time.sleep(0.3)
    assert not os.path.exists(core.back / "d" / ".metadata"), \
        "a pointer landed before another node's shard"
    assert oplog.applied_seq < last
    paused.frontier = float("inf")         # the other node persisted shard_b
    core.drain(last)
    assert os.path.exists(core.back / "d" / ".metadata")


@given(dirs=st.lists(st.sampled_from([b"d", b"e"]), min_size=2, max_size=12),
       split=st.integers(min_value=0, max_value=12))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_nothing_lands_past_a_paused_nodes_frontier_whatever_the_groups(dirs, split):
    """Property, against the rule's model: files published in a random order into two
    directories (so that groups form and break at random), another node paused with a change
    acknowledged between the ``split``-th and the next; the sequencer starts once the first
    uploads are done. While that node is paused exactly the files closed before its change
    land; once it goes on, all of them."""
    split = min(split, len(dirs))
    root_dir = Path(tempfile.mkdtemp(prefix="acpfs-groups-"))
    paused = PausedNode()
    core = Parts(root_dir, blocks=256, peers=paused)
    try:
        cache, back, oplog = core.cache, core.backing, core.oplog
        root = cache.inodes.root
        made = {name: cache.names.mkdir(root, name, 0o755, 0, 0) for name in (b"z", b"d", b"e")}
        core.drain()
        first = back.inject("create_temp", path="z/", hang=True)   # the sequencer waits
        publish_all(cache, made[b"z"], [b"x0"])
        wait_for(first.entered.is_set, "x0 not uploading")
        names = []
        for i, d in enumerate(dirs):
            if i == split:
                paused.frontier = oplog.next_stamp()   # the other node's change
            name = b"f%02d" % i
            publish_all(cache, made[d], [name])
            names.append(os.path.join(os.fsdecode(d), os.fsdecode(name)))
        last = oplog.seq
        time.sleep(0.05)   # some uploads finish meanwhile (as many as the flusher launches)
        first.release()
        for path in names[:split]:
            wait_for(lambda: os.path.exists(core.back / path), f"{path} did not land")
        time.sleep(0.1)
        landed = [p for p in names if os.path.exists(core.back / p)]
        assert landed == names[:split], (landed, split)
        paused.frontier = float("inf")
        core.drain(last)
        assert all(os.path.exists(core.back / p) for p in names)
    finally:
        paused.frontier = float("inf")   # nothing held: the flusher drains and stops
        core.close()
        shutil.rmtree(root_dir, ignore_errors=True)
