"""Recovery: what ``plan`` picks from a dead daemon's journal, and ``recover`` end to end in
process: a journal built by real cache operations while the flusher is held, the daemon
"killed" (its flusher aborted, nothing drained), a new cache over the same pool file and
backing replaying it, and the backing checked byte for byte."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from acpfs.oplog import journal as jmod
from acpfs.daemon import recovery
from acpfs.cache.cache import Cache
from acpfs.flusher.flusher import Flusher
from acpfs.oplog.journal import CLEAN, DIRTY, FLUSHED, Journal, Leftover, Record
from acpfs.oplog.log import OpLog
from acpfs.store.pool import Pool
from acpfs.daemon.recovery import claimed_content, plan
from faulty import FaultyBacking
import trees
from harness import BS, make_store, write_file


def content(seq: int, ino: int, path: bytes, blocks=(1,), kind: str = FLUSHED) -> Record:
    return Record(seq, kind, ino, path, size=len(blocks) * BS, mode=0o100644, uid=0, gid=0,
                  times=(1, 2), blocks=list(blocks))


def left_of(records: list[Record], applied: int) -> Leftover:
    return Leftover(BS, 64 * BS, records, applied, 0)


def rename(seq: int, ino: int, src: bytes, dst: bytes) -> Record:
    return Record(seq, "rename", ino, dst, src_path=src)


# -- plan --------------------------------------------------------------------------------

def test_ops_after_applied_are_replayed_in_order():
    recs = [Record(1, "mkdir", 2, b"a", mode=0o40755, uid=0, gid=0),
            Record(2, "unlink", 3, b"x"),
            Record(3, "mkdir", 4, b"b", mode=0o40755, uid=0, gid=0),
            content(4, 5, b"b/f", kind="publish"),
            Record(5, "xattr", 4, b"b", key=b"user.k", value=b"v")]
    replay, dirty = plan(left_of(recs, applied=2))
    assert replay == recs[2:] and dirty == []
    assert plan(left_of(recs, applied=0))[0] == recs
    assert plan(left_of(recs, applied=5)) == ([], [])


def test_the_last_state_record_of_a_file_wins():
    f_dirty, f_flushed = Record(0, DIRTY, 5, b"f"), content(0, 5, b"f")
    g_flushed, g_dirty = content(0, 6, b"g"), Record(0, DIRTY, 6, b"g")
    h_flushed, h_clean = content(0, 7, b"h"), Record(0, CLEAN, 7)
    i_flushed, i_publish = content(0, 8, b"i"), content(3, 8, b"i", kind="publish")
    j_flushed, j_publish = content(0, 9, b"j"), content(2, 9, b"j", kind="publish")
    recs = [f_dirty, g_flushed, h_flushed, i_flushed, j_flushed, Record(1, "unlink", 20, b"z"),
            j_publish, i_publish, f_flushed, g_dirty, h_clean]
    replay, dirty = plan(left_of(recs, applied=2))
    # f: flushed after dirty -> published; g: dirty after flushed -> open at the crash;
    # h: clean -> nothing; i: its publish (not applied) supersedes the flushed record;
    # j: its publish is applied already -> nothing
    assert replay == [i_publish, f_flushed]
    assert dirty == [g_dirty]


def test_a_flushed_path_follows_renames_already_applied_and_not_later_ones():
    recs = [content(0, 5, b"d/f"),               # close() acknowledged as d/f
            content(0, 6, b"dd/f"),              # a sibling directory sharing the prefix
            Record(0, DIRTY, 7, b"d/sub/o"),     # open at the crash, under d
            rename(1, 5, b"d/f", b"d/g"),        # applied: the file renamed
            rename(2, 2, b"d", b"e"),            # applied: its directory renamed
            rename(3, 5, b"e/g", b"top"),        # not applied: replayed after the content
            rename(4, 6, b"dd", b"ee")]          # not applied either
    left = left_of(recs, applied=2)
    replay, dirty = plan(left)
    assert [(r.kind, r.ino, r.path) for r in replay] == [
        (FLUSHED, 5, b"e/g"), (FLUSHED, 6, b"dd/f"), ("rename", 5, b"top"), ("rename", 6, b"ee")]
    assert [(r.ino, r.path) for r in dirty] == [(7, b"e/sub/o")]
    # on copies: the leftover keeps what the journal says
    assert [r.path for r in left.records[:3]] == [b"d/f", b"dd/f", b"d/sub/o"]


def test_the_other_names_of_a_flushed_file_follow_renames_already_applied_too():
    rec = content(0, 5, b"f")
    rec.links = [b"d/g", b"dd/h", b"d"]
    recs = [rec, rename(1, 2, b"d", b"e")]
    replay, _ = plan(left_of(recs, applied=1))
    assert replay[0].path == b"f" and replay[0].links == [b"e/g", b"dd/h", b"e"]
    assert rec.links == [b"d/g", b"dd/h", b"d"]    # the leftover is kept as it was


def test_renames_before_the_record_do_not_move_it():
    recs = [rename(1, 2, b"d", b"e"),            # applied, and before the close
            content(0, 5, b"e/f"),
            rename(2, 5, b"e/f", b"e/g")]        # applied, after the close
    replay, _ = plan(left_of(recs, applied=2))
    assert [r.path for r in replay] == [b"e/g"]


def test_a_flushed_record_of_a_deleted_file_keeps_no_path():
    recs = [Record(0, FLUSHED, 5, None, size=0, mode=0o100644, uid=0, gid=0, times=(1, 2)),
            rename(1, 2, b"d", b"e")]
    replay, _ = plan(left_of(recs, applied=1))
    assert [r.path for r in replay] == [None]


def test_every_kind_of_operation_but_publish_has_a_replay():
    """``Replayer.apply`` replays each kind of journal record by a table; a kind of
    operation left out of it would be skipped as an internal error at every recovery."""
    from acpfs.node import OpKind
    assert set(recovery.Replayer.BY_KIND) == set(OpKind) - {OpKind.PUBLISH}
    assert not set(recovery.Replayer.BY_KIND) & set(jmod.CONTENT_KINDS)


def test_claimed_blocks_counts_repeats(tmp_path):
    recs = [content(0, 5, b"f", blocks=(3, 4, -1)),
            content(2, 5, b"f", blocks=(3, 9), kind="publish"),
            Record(3, "mkdir", 6, b"d", mode=0o40755, uid=0, gid=0),
            Record(0, DIRTY, 7, b"o")]
    assert claimed_content(recs) == [[3, 4, -1], [3, 9]]
    pool = Pool(str(tmp_path / "pool"), 16 * BS, BS)
    try:
        pool.claim_refs(claimed_content(recs))
        assert [int(pool.refcount[b]) for b in (3, 4, 9, 0)] == [2, 1, 1, 0]
        assert pool.used_blocks == 3 and 3 not in pool.free and 0 in pool.free
        with pytest.raises(ValueError, match="outside the pool"):
            pool.claim([16])
    finally:
        pool.close()


# -- recover, end to end ---------------------------------------------------------------------

def tree(root: Path) -> dict[str, object]:
    """Everything under ``root``: files as their bytes, symlinks as ("link", target),
    directories as "dir"."""
    return trees.tree(root, skip=trees.NOTHING, modes=False)


class Restarted:
    """A daemon's core rebuilt over a dead one's cache directory, as ``Daemon.build`` and
    ``Daemon.recover`` do it (no mount)."""

    def __init__(self, back: Path, cache_dir: Path, workers: int = 2) -> None:
        self.back, self.cache_dir = back, cache_dir
        left = self.left = jmod.read_leftover(str(cache_dir))
        assert left is not None
        self.replay, self.dirty = recovery.plan(left)
        jmod.start_recovery(str(cache_dir))
        self.store = make_store(cache_dir, left.pool_size, left.block_size, unit=left.block_size)
        self.store.claim_refs(recovery.claimed_content(self.replay))
        self.backing = FaultyBacking(str(back), dead_instance=left.instance)
        self.base_seq = left.last_seq
        self.journal = Journal(str(cache_dir), self.store.unit, self.store.limit,
                               self.backing.instance)
        self.oplog = OpLog(self.store, self.journal, applied_seq=self.base_seq)
        self.cache = Cache(self.oplog, self.backing, self.store)
        self.flusher = Flusher(self.oplog, self.cache, self.backing, None, workers)
        self.report = None

    def recover(self, before_start=lambda: None) -> recovery.Recovered:
        self.report = recovery.recover(self.cache, self.left, self.replay, self.dirty)
        jmod.finish_recovery(str(self.cache_dir))
        with self.oplog.lock:
            self.journal.applied(self.base_seq)
        jmod.forget_direct_writes(str(self.cache_dir))
        before_start()
        self.flusher.start()
        return self.report

    def drain(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.flusher.oplog.applied_seq < self.cache.oplog.seq:
            assert time.monotonic() < deadline, "flusher did not drain"
            assert self.flusher.thread.is_alive(), "flusher died"
            time.sleep(0.002)

    def close(self) -> None:
        self.backing.clear()
        if self.flusher.thread.ident is not None:          # started (maybe killed since)
            self.flusher.stop(drain=not self.flusher.abort.is_set(), timeout=20)
        else:                                              # killed before it started
            self.flusher.uploads.shutdown(wait=False)
        self.journal.close()
        self.store.close()
        self.backing.close()


@pytest.fixture
def restart():
    made: list[Restarted] = []

    def make(core) -> Restarted:
        r = Restarted(core.back, core.cache_dir)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def hold(core):
    """Hold the flusher: every backing call from now on hangs, and fails with EIO once let
    go (``kill``), so that a killed daemon applies nothing more."""
    return core.backing.inject(hang=True, errno=errno.EIO)


def kill(core, held) -> None:
    """SIGKILL, as far as the cache directory can tell: the flusher stops where it is and
    nothing more is applied or drained. The pool file, the journal and the applied counter
    stay in the cache directory as they are."""
    fl = core.flusher
    fl.stop(drain=False, timeout=0)            # abort: no more retries, no further op
    held.release()                             # the held calls fail (EIO), as will any other
    fl.stop(drain=False, timeout=10)
    assert not fl.thread.is_alive()


EXPECTED = {
    "d": "dir", "d/g": b"G" * (3 * BS + 7),
    "e": "dir", "e/f2": b"one" * 2000,
    "l": ("link", "e/f2"),
    "k": b"",
    "h": b"H" * (2 * BS),
    "o": b"o before",                                    # open at the crash: previous version
}


def killed_daemon(tmp_path, make_core, before=lambda core: None):
    """A daemon that persisted d/f, then made the changes of EXPECTED (and a few that cancel
    out) while its flusher was held, and was killed. Returns its (dead) core. ``before(core)``
    runs before its first change."""
    back = tmp_path / "a" / "back"         # the backing as the dead daemon found it
    back.mkdir(parents=True)
    (back / "old").write_bytes(b"old bytes")
    (back / "o").write_bytes(b"o before")
    c = make_core("a", journal=True)
    before(c)
    cache = c.cache
    root = cache.inodes.root

    # applied before the crash: d/, d/f
    d = cache.names.mkdir(root, b"d", 0o755, 0, 0)
    f = write_file(cache, b"f", b"one" * 2000, parent=d)
    cache.files.release(f, True)
    c.drain()
    c.applied_before = c.flusher.oplog.applied_seq
    assert (c.back / "d" / "f").read_bytes() == b"one" * 2000

    h = hold(c)
    g = write_file(cache, b"g", b"G" * (3 * BS + 7), parent=d)
    cache.files.release(g, True)                                   # publish d/g
    cache.names.setattr(g, mode=0o600)                             # chmod after the close
    e = cache.names.mkdir(root, b"e", 0o750, 0, 0)
    cache.names.set_xattr(e, b"user.k", b"v")
    cache.names.rename(d, b"f", e, b"f2")                          # a persisted file moves
    cache.names.symlink(root, b"l", b"e/f2", 0, 0)
    cache.names.unlink(root, b"old")
    k = write_file(cache, b"k", b"")                          # empty file
    cache.files.release(k, True)
    hf = write_file(cache, b"h", b"H" * (2 * BS))            # close() answered (FLUSH), no
    cache.files.record_close(hf)                                   # RELEASE before the kill
    o = cache.names.lookup(root, b"o")                             # open for writing at the crash
    cache.files.open(o, True, True)
    cache.files.write(o, 0, b"unsaved")
    tmp = write_file(cache, b"tmp", b"T" * BS)              # created and deleted: never lands
    cache.files.release(tmp, True)
    cache.names.unlink(root, b"tmp")
    assert h.entered.wait(5)
    assert c.flusher.oplog.applied_seq == c.applied_before
    kill(c, h)
    assert tree(c.back) == {"d": "dir", "d/f": b"one" * 2000, "old": b"old bytes",
                            "o": b"o before"}
    # an upload the dead daemon left half written (its instance is in the journal), and one
    # of another daemon (another node's upload in flight): only the first is removed
    (c.back / "d" / os.fsdecode(c.backing.temp_name())).write_bytes(b"GG")
    (c.back / OTHER_NODES_UPLOAD).write_bytes(b"other node")
    return c


OTHER_NODES_UPLOAD = "d/.acpfs-tmp-0123456789ab-00112233445566ff"


def check_backing(back: Path) -> None:
    assert tree(back) == {**EXPECTED, OTHER_NODES_UPLOAD: b"other node"}
    assert stat.S_IMODE(os.stat(back / "d" / "g").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(back / "e").st_mode) == 0o750
    assert os.getxattr(back / "e", "user.k") == b"v"


def test_recover_replays_what_a_killed_daemon_left(tmp_path, make_core, restart):
    c = killed_daemon(tmp_path, make_core)
    r = restart(c)
    assert r.left.applied == c.applied_before and r.left.torn == 0
    report = r.recover()
    r.drain()
    assert report.lost_open_files == ["o"] and report.kept_aside == []
    assert report.files == 4             # d/g, k, h (its close() only) and tmp (then unlinked)
    assert report.replayed_ops == 7 and report.skipped == 0
    check_backing(c.back)
    assert not (c.cache_dir / jmod.RECOVERING).exists()
    # every block still held is a cached file's (the claimed ones went to the replayed files)
    assert r.store.used == sum(r.store.nbytes(n.content) for n in r.cache.inodes.nodes.values() if n.content is not None)


def test_a_recovered_daemon_killed_again_before_persisting_is_recovered_again(
        tmp_path, make_core, restart):
    c = killed_daemon(tmp_path, make_core)
    r = restart(c)
    held = []
    r.recover(before_start=lambda: held.append(hold(r)))
    assert held[0].entered.wait(5)
    kill(r, held[0])
    assert tree(c.back)["d/f"] == b"one" * 2000 and "e" not in tree(c.back)
    assert not (c.cache_dir / jmod.RECOVERING).exists()
    r2 = restart(c)                      # from the journal the first recovery wrote
    assert r2.left.applied == r.base_seq
    assert min(x.seq for x in r2.left.records if x.seq) == r.base_seq + 1
    report = r2.recover()
    r2.drain()
    assert report.lost_open_files == []  # said (and logged) by the first recovery
    check_backing(c.back)


def test_a_daemon_killed_during_recovery_is_recovered_from_the_same_journal(
        tmp_path, make_core, restart):
    c = killed_daemon(tmp_path, make_core)
    first = restart(c)                   # killed before its replay finished
    assert (c.cache_dir / jmod.RECOVERING).exists()
    second = restart(c)
    assert [(x.seq, x.kind, x.path) for x in second.left.records] == \
        [(x.seq, x.kind, x.path) for x in first.left.records]
    report = second.recover()
    second.drain()
    assert report.lost_open_files == ["o"]
    check_backing(c.back)


def test_written_through_files_are_published_or_kept_aside(tmp_path, make_core, restart):
    """Files too large for the cache live in staged files in the backing. One whose close()
    was answered (FLUSH, no RELEASE before the kill) is published from its staged file; one
    still open for writing keeps its previous version, and what was written to it is kept
    aside in .acpfs-recovered/."""
    import trio

    from acpfs.backing.backing import RECOVERED_DIR
    from triocore import ROOT, create, pattern, run, write

    back = tmp_path / "w" / "back"
    back.mkdir(parents=True)
    (back / "open").write_bytes(b"previous version")
    c = make_core("w", blocks=16, journal=True)
    big = pattern(17 * BS + 3, seed=1)
    partial = pattern(20 * BS, seed=2)
    staged = []

    async def test(core):
        fh, node = await create(core, b"big")
        await write(core, fh, big)
        assert node.staged is not None
        core.handles.flush(fh)                                 # close() answered; RELEASE never comes
        o = await core.lookup(ROOT, b"open")
        fo, _, _ = await core.handles.open(o.ino, os.O_WRONLY | os.O_TRUNC)
        await write(core, fo, partial)
        assert o.staged is not None
        staged.extend([node.staged, o.staged])
        await trio.sleep(0)
    run(c, test)
    c.flusher.stop(drain=False, timeout=5)             # killed: nothing was queued anyway
    assert sorted(os.listdir(c.back)) == [os.fsdecode(c.backing.staging_dir), "open"]

    r = restart(c)
    report = r.recover()
    r.drain()
    for sp in staged:                                  # the dead daemon's descriptors
        os.close(sp.fd)
        os.close(sp.dir_fd)
    assert (c.back / "big").read_bytes() == big
    assert (c.back / "open").read_bytes() == b"previous version"
    assert len(report.kept_aside) == 1 and report.lost_open_files == []
    aside = c.back / report.kept_aside[0]
    assert aside.parent.parent == c.back / os.fsdecode(RECOVERED_DIR)
    assert aside.name == "open"
    assert aside.read_bytes() == partial
    assert sorted(os.listdir(c.back)) == [os.fsdecode(RECOVERED_DIR), "big", "open"]


def _killed_with_d_f_pending_and_d_moved_away(make_core):
    """A daemon killed while d/f's acknowledged content was being published, whose backing
    then lost d (renamed to d.away behind acpfs's back): its content must be kept aside."""
    c = make_core("k", journal=True)
    cache = c.cache
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    c.drain()
    h = hold(c)
    cache.files.release(write_file(cache, b"f", b"acknowledged", parent=d), True)
    assert h.entered.wait(5)
    kill(c, h)
    os.rename(c.back / "d", c.back / "d.away")
    return c


@pytest.mark.parametrize("how", ["moved away", "a symlink now"])
def test_acknowledged_content_whose_directory_is_gone_is_kept_aside(tmp_path, make_core, restart,
                                                                     how):
    """Acknowledged content must not be dropped as done: the backing lost a pending file's
    directory behind acpfs's back before the crash. The content its close() acknowledged is kept
    aside, never dropped as 'already done'."""
    from acpfs.backing.backing import RECOVERED_DIR

    c = _killed_with_d_f_pending_and_d_moved_away(make_core)
    if how == "a symlink now":
        os.symlink("d.away", c.back / "d")
    r = restart(c)
    report = r.recover()
    r.drain()
    assert report.kept_aside and report.kept_aside[0].startswith(os.fsdecode(RECOVERED_DIR) + "/")
    assert (c.back / report.kept_aside[0]).read_bytes() == b"acknowledged"
    assert os.path.basename(report.kept_aside[0]) == "d%2Ff"
    assert os.listdir(c.back / "d.away") == []        # nothing went through the symlink


def test_a_new_version_of_a_linked_file_cut_between_its_names_is_finished_by_the_replay(
        tmp_path, make_core, restart):
    """f and d/g are one file in the backing; its new version landed under f, and the daemon
    died before it linked it under d/g (the backing: f new, d/g the old version, two
    inodes). The replay gives the file its name d/g back from the journal (a content record
    carries a file's other names) and lands the new version under both, one inode again."""
    c = make_core("a", journal=True)
    cache, root = c.cache, c.cache.inodes.root
    d = cache.names.mkdir(root, b"d", 0o755, 0, 0)
    f = write_file(cache, b"f", b"v1")
    cache.files.release(f, True)
    cache.names.link(f, d, b"g")
    c.drain()
    assert os.stat(c.back / "f").st_ino == os.stat(c.back / "d" / "g").st_ino
    held = c.backing.inject("link", hang=True, errno=errno.EIO)   # between the names
    cache.files.open(f, True, True)
    cache.files.write(f, 0, b"v2 longer")
    cache.files.release(f, True)
    assert held.entered.wait(5)
    assert tree(c.back) == {"f": b"v2 longer", "d": "dir", "d/g": b"v1"}
    kill(c, held)
    r = restart(c)
    r.recover()
    r.drain()
    assert tree(c.back) == {"f": b"v2 longer", "d": "dir", "d/g": b"v2 longer"}
    assert os.stat(c.back / "f").st_ino == os.stat(c.back / "d" / "g").st_ino
    assert os.stat(c.back / "f").st_nlink == 2


def test_content_to_keep_aside_while_the_backing_refuses_changes_is_queued_not_fatal(
        tmp_path, make_core, restart):
    """A refused set-aside must not stop the recovery: a recovery that must keep content aside
    while the backing refuses changes (here mkdir of .acpfs-recovered: EPERM, as on an immutable
    root) used to fail, and with it the mount. Now setting aside writes nothing during the
    recovery: the file is made in the mount under .acpfs-recovered/<time>/ and queued like any
    change, so the failure is the flusher's, retried and shown (Op.error). Its content stays in
    the pool and in the new journal: a daemon killed again before it lands recovers it again."""
    c = _killed_with_d_f_pending_and_d_moved_away(make_core)

    r = restart(c)
    refused = r.backing.inject("mkdir", path=".acpfs-recovered", errno=errno.EPERM)
    report = r.recover()                                # no exception: the mount goes on
    [aside] = report.kept_aside
    assert aside.startswith(".acpfs-recovered/") and aside.endswith("/d%2Ff")
    assert report.aside_seqs[aside] > r.flusher.oplog.applied_seq
    assert "aside_seqs" not in report.as_dict()
    assert refused.entered.wait(5)
    deadline = time.monotonic() + 5
    while not (r.flusher.oplog.queue and r.flusher.oplog.queue[0].error):
        assert time.monotonic() < deadline, "the refused mkdir is not shown as failing"
        time.sleep(0.01)
    failing = r.flusher.oplog.queue[0]
    assert failing.kind == "mkdir" and failing.path == ".acpfs-recovered"
    assert "EPERM" in failing.error
    # the mount serves it meanwhile, from the pool
    parent, name, node = recovery.Replayer(r.cache, report, set()).resolve(os.fsencode(aside))
    assert node is not None and bytes(r.cache.files.read(node, 0, 100)) == b"acknowledged"
    assert not (c.back / ".acpfs-recovered").exists()

    r.flusher.stop(drain=False, timeout=10)             # killed again before it landed
    assert not r.flusher.thread.is_alive()
    r2 = restart(c)
    report2 = r2.recover()
    r2.drain()
    assert report2.kept_aside == [] and report2.skipped == 0
    assert (c.back / aside).read_bytes() == b"acknowledged"
    assert os.listdir(c.back / "d.away") == []
