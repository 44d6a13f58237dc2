"""The journal on its own: framing, torn and corrupt tails, the record format (which must
read journals written by the previous version), appends, the idle cut-back, failing writes,
and the direct-writes list."""

from __future__ import annotations

import errno
import marshal
import os
import struct
import zlib

import pytest

import acpfs.oplog.journal as jmod
from acpfs.oplog.journal import (APPLIED, CLEAN, DIRECT, DIRTY, FLUSHED, FRAME, HEADER, JOURNAL, LAYOUT, MAGIC,
                           RECOVERING, Journal, Record, pack_blocks, read_direct_writes, read_leftover,
                           record_direct_write)

BS = 4096
POOL = 64 * BS

# The stored field order of every kind, as the previous version (format 01) wrote them.
# A change of an existing kind breaks journals left by a daemon of the previous version:
# never make one. New kinds may be added (a journal holding one needs this version to replay).
FORMAT_01 = {
    "publish": ("path", "size", "mode", "uid", "gid", "times", "xattrs", "blocks", "staged_name"),
    "flushed": ("path", "size", "mode", "uid", "gid", "times", "xattrs", "blocks", "staged_name"),
    "mkdir": ("path", "mode", "uid", "gid"),
    "symlink": ("path", "target", "uid", "gid"),
    "mknod": ("path", "mode", "uid", "gid", "size"),   # a kind added later: others unchanged
    "unlink": ("path",),
    "rmdir": ("path",),
    "rename": ("src_path", "path"),
    "link": ("src_path", "path"),                      # added later too
    "setattr": ("path", "mode", "uid", "gid", "times"),
    "xattr": ("path", "key", "value"),
    "dirty": ("path",),
    "clean": (),
}

# A value for every field a record can carry, none of them the dataclass default.
VALUES = {
    "path": b"d/f\xff",            # paths are bytes, not necessarily UTF-8
    "src_path": b"d/old",
    "size": 3 * BS + 5,
    "mode": 0o100640,
    "uid": 1001,
    "gid": 1002,
    "times": (1_700_000_000_123_456_789, 1_700_000_001_000_000_000),
    "xattrs": {b"user.a": b"1", b"user.b": b""},
    "blocks": [7, -1, 3, 60],      # -1: a hole
    "staged_name": b".acpfs-tmp-a1b2c3d4e5f6-0123456789abcdef-i5",
    "target": b"../t",
    "key": b"user.k",
    "value": b"v",
}


def record_of(kind: str, seq: int = 9, ino: int = 42) -> Record:
    return Record(seq, kind, ino, **{f: VALUES[f] for f in LAYOUT[kind]})


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def write_journal(cache_dir, payloads: list[bytes], applied: int | None = None,
                  name: str = JOURNAL, header: bytes | None = None) -> bytes:
    data = (header or HEADER.pack(MAGIC, BS, POOL, b"a1b2c3")) + b"".join(frame(p) for p in payloads)
    (cache_dir / name).write_bytes(data)
    if applied is not None:
        (cache_dir / APPLIED).write_bytes(applied.to_bytes(8, "little"))
    return data


def three_records() -> list[Record]:
    return [Record(1, "mkdir", 2, b"d", mode=0o40755, uid=0, gid=0),
            record_of("publish", seq=2, ino=3),
            Record(0, DIRTY, 4, b"d/open")]


# -- the record format -----------------------------------------------------------------

def test_layout_is_format_01():
    assert LAYOUT == FORMAT_01


@pytest.mark.parametrize("kind", sorted(FORMAT_01))
def test_record_round_trip_and_stored_tuple(kind):
    rec = record_of(kind)
    payload = rec.encode()
    stored = marshal.loads(payload)
    expected = [VALUES[f] for f in FORMAT_01[kind]]
    if "blocks" in FORMAT_01[kind]:
        expected[FORMAT_01[kind].index("blocks")] = pack_blocks(VALUES["blocks"])
    assert stored == (9, kind, 42, *expected)
    assert type(stored[1]) is str
    back = Record.decode(payload)
    assert back == rec
    if "times" in FORMAT_01[kind]:
        assert isinstance(back.times, tuple)


@pytest.mark.parametrize("kind", ["publish", "flushed"])
def test_a_content_record_carries_the_other_names_of_a_file_after_its_format_01_fields(kind):
    rec = record_of(kind)
    rec.links = [b"d/g", b"h\xff"]
    stored = marshal.loads(rec.encode())
    assert stored[:-1] == marshal.loads(record_of(kind).encode())   # the same, then the names
    assert stored[-1] == [b"d/g", b"h\xff"]
    assert Record.decode(rec.encode()) == rec
    assert Record.decode(record_of(kind).encode()).links == []     # a record without them


def test_op_kinds_are_stored_as_plain_strings():
    from acpfs.node import OpKind
    rec = Record(3, OpKind.UNLINK, 8, b"gone")
    stored = marshal.loads(rec.encode())
    assert stored == (3, "unlink", 8, b"gone") and type(stored[1]) is str


def test_records_written_by_the_previous_version_are_read(tmp_path):
    """Tuples built exactly as the previous version's Cache._record/_state_record built them."""
    blocks = pack_blocks([0, 1, -1])
    old = [
        (1, "mkdir", 2, b"d", 0o40755, 0, 0),
        (2, "publish", 3, b"d/f", 9000, 0o100644, 10, 20, (5, 6), {b"user.x": b"y"}, blocks, b""),
        (3, "symlink", 4, b"l", b"d/f", 0, 0),
        (4, "rename", 3, b"d/f", b"d/g"),
        (5, "setattr", 3, b"d/g", 0o100600, None, None, None),
        (6, "setattr", 3, b"d/g", None, 7, 8, (1, 2)),
        (7, "xattr", 3, b"d/g", b"user.k", None),
        (8, "unlink", 4, b"l"),
        (9, "rmdir", 5, b"e"),
        (0, "flushed", 6, b"h", 4, 0o100644, 0, 0, (3, 4), {}, pack_blocks([2]), b".acpfs-tmp-a1b2c3-1-i6"),
        (0, "dirty", 7, b"o"),
        (0, "clean", 7),
    ]
    write_journal(tmp_path, [marshal.dumps(t) for t in old], applied=3)
    left = read_leftover(str(tmp_path))
    assert left is not None and left.applied == 3 and left.torn == 0
    assert left.instance == "a1b2c3"
    assert (left.block_size, left.pool_size) == (BS, POOL)
    recs = left.records
    assert [r.kind for r in recs] == [t[1] for t in old]
    assert recs[1] == Record(2, "publish", 3, b"d/f", size=9000, mode=0o100644, uid=10, gid=20,
                             times=(5, 6), xattrs={b"user.x": b"y"}, blocks=[0, 1, -1])
    assert recs[3].src_path == b"d/f" and recs[3].path == b"d/g"
    assert (recs[4].mode, recs[4].uid, recs[4].times) == (0o100600, None, None)
    assert (recs[5].mode, recs[5].uid, recs[5].gid, recs[5].times) == (None, 7, 8, (1, 2))
    assert (recs[6].key, recs[6].value) == (b"user.k", None)
    assert recs[9].staged_name == b".acpfs-tmp-a1b2c3-1-i6" and recs[9].blocks == [2]
    assert recs[11] == Record(0, CLEAN, 7)
    # and what this version writes is the tuple the previous one wrote (the bytes may
    # differ only in marshal's reference flags, which depend on object identity)
    for t, r in zip(old, recs):
        assert marshal.loads(r.encode()) == t, t


def test_unknown_kind_raises():
    with pytest.raises(KeyError):
        Record(1, "chown", 2, b"x").encode()
    with pytest.raises(ValueError, match="unknown journal record 'chown'"):
        Record.decode(marshal.dumps((1, "chown", 2, b"x")))
    with pytest.raises(ValueError, match="'mkdir' with 2 fields"):   # a known kind, wrong arity
        Record.decode(marshal.dumps((1, "mkdir", 2, b"x", 0o755)))


# -- framing ----------------------------------------------------------------------------

def test_every_cut_of_the_last_frame_is_ignored(tmp_path):
    payloads = [r.encode() for r in three_records()]
    data = write_journal(tmp_path, payloads, applied=1)
    last_start = len(data) - FRAME.size - len(payloads[-1])
    for cut in range(last_start, len(data)):
        (tmp_path / JOURNAL).write_bytes(data[:cut])
        left = read_leftover(str(tmp_path))
        assert left is not None
        assert left.records == three_records()[:2], cut
        assert left.torn == cut - last_start, cut
        assert left.applied == 1
    (tmp_path / JOURNAL).write_bytes(data)
    left = read_leftover(str(tmp_path))
    assert left.records == three_records() and left.torn == 0


def test_crc_mismatch_stops_reading_there(tmp_path):
    payloads = [r.encode() for r in three_records()]
    data = bytearray(write_journal(tmp_path, payloads))
    second = HEADER.size + FRAME.size + len(payloads[0])
    data[second + FRAME.size + 3] ^= 0xFF        # one bit flip in the second record's payload
    (tmp_path / JOURNAL).write_bytes(bytes(data))
    left = read_leftover(str(tmp_path))
    assert left.records == three_records()[:1]  # the intact third one is not trusted either
    assert left.torn == len(data) - second


def test_a_length_beyond_the_file_is_a_torn_tail(tmp_path):
    payloads = [three_records()[0].encode()]
    data = write_journal(tmp_path, payloads) + struct.pack("<II", 1 << 30, 0) + b"xyz"
    (tmp_path / JOURNAL).write_bytes(data)
    left = read_leftover(str(tmp_path))
    assert left.records == three_records()[:1] and left.torn == FRAME.size + 3


def test_header_only_short_and_missing_journals(tmp_path):
    assert read_leftover(str(tmp_path)) is None                     # no journal at all
    (tmp_path / JOURNAL).write_bytes(HEADER.pack(MAGIC, BS, POOL, b""))
    left = read_leftover(str(tmp_path))
    assert left is not None and left.records == [] and left.torn == 0
    assert left.applied == 0 and left.last_seq == 0                # no applied file: 0
    assert (left.block_size, left.pool_size) == (BS, POOL)
    for n in (0, 1, HEADER.size - 1):                               # cut inside the header
        (tmp_path / JOURNAL).write_bytes(HEADER.pack(MAGIC, BS, POOL, b"")[:n])
        assert read_leftover(str(tmp_path)) is None


def test_wrong_magic_raises_a_clear_error(tmp_path):
    (tmp_path / JOURNAL).write_bytes(HEADER.pack(b"ACPFSJ00", BS, POOL, b""))
    with pytest.raises(ValueError, match=r"journal is not an acpfs journal \(or from an incompatible"):
        read_leftover(str(tmp_path))
    # format 01 (no instance in the header; never released) is not read either
    (tmp_path / JOURNAL).write_bytes(struct.pack("<8sQQ", b"ACPFSJ01", BS, POOL)
                                     + frame(three_records()[0].encode()))
    with pytest.raises(ValueError, match=r"journal is not an acpfs journal \(or from an incompatible"):
        read_leftover(str(tmp_path))


def test_the_journal_being_recovered_comes_first(tmp_path):
    recs = three_records()
    write_journal(tmp_path, [recs[0].encode()], applied=0, name=RECOVERING)
    write_journal(tmp_path, [recs[1].encode()], name=JOURNAL)
    left = read_leftover(str(tmp_path))
    assert left.records == recs[:1]
    assert left.last_seq == 1


def test_applied_and_last_seq(tmp_path):
    write_journal(tmp_path, [r.encode() for r in three_records()], applied=7)
    left = read_leftover(str(tmp_path))
    assert left.applied == 7 and left.last_seq == 7    # applied beyond every record
    (tmp_path / APPLIED).write_bytes(b"")               # created, never written
    assert read_leftover(str(tmp_path)).applied == 0


# -- the running journal ------------------------------------------------------------------

class LiveJournal(Journal):
    """A journal appended to as OpLog appends: cut back to ``live`` once idle."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.live: list[Record] = []

    def append(self, record: Record, live=None) -> None:
        super().append(record, lambda: list(self.live))


@pytest.fixture
def journal(tmp_path):
    j = LiveJournal(str(tmp_path), BS, POOL)
    yield j
    j.close()


def on_disk(tmp_path) -> list[Record]:
    left = read_leftover(str(tmp_path))
    assert left is not None and left.torn == 0
    return left.records


def test_append_writes_framed_records(journal, tmp_path):
    recs = three_records()
    for r in recs:
        journal.append(r)
    assert on_disk(tmp_path) == recs
    assert journal.size == os.path.getsize(tmp_path / JOURNAL)
    assert journal.error is None
    assert os.stat(tmp_path / JOURNAL).st_mode & 0o777 == 0o600


def test_a_new_journal_truncates_an_old_one(tmp_path):
    write_journal(tmp_path, [r.encode() for r in three_records()])
    j = Journal(str(tmp_path), BS, POOL)
    try:
        assert on_disk(tmp_path) == []
    finally:
        j.close()


def test_applied_is_written_and_idle_cuts_back_at_the_next_append(journal, tmp_path):
    a, b, c = (Record(s, "unlink", s, b"f%d" % s) for s in (1, 2, 3))
    journal.append(a)
    journal.append(b)
    journal.applied(1)
    assert read_leftover(str(tmp_path)).applied == 1
    assert not journal.idle
    journal.applied(2, idle=True)
    assert journal.idle
    assert on_disk(tmp_path) == [a, b]         # nothing is cut until the next append
    assert read_leftover(str(tmp_path)).applied == 2
    journal.live.extend([Record(0, DIRTY, 9, b"open"), record_of(FLUSHED, seq=0, ino=10)])
    journal.append(c)
    assert on_disk(tmp_path) == [Record(0, DIRTY, 9, b"open"), record_of(FLUSHED, seq=0, ino=10), c]
    assert not journal.idle
    journal.live.clear()
    journal.append(Record(4, "rmdir", 4, b"d"))       # not idle: no cut
    assert len(on_disk(tmp_path)) == 4


class OsWith:
    """``os`` as acpfs.oplog.journal sees it, with ``write`` replaced."""

    def __init__(self, write):
        self.write = write

    def __getattr__(self, name):
        return getattr(os, name)


def failing_write(monkeypatch, how: str, times: int = 1):
    """Make the journal's next ``times`` writes fail: 'short' writes half and returns the
    count, 'enospc' writes half and then raises ENOSPC (a torn record on disk either way)."""
    left = [times]

    def write(fd, data):
        if left[0] <= 0:
            return os.write(fd, data)
        left[0] -= 1
        n = os.write(fd, bytes(data[:len(data) // 2]))
        if how == "short":
            return n
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(jmod, "os", OsWith(write))


@pytest.mark.parametrize("how", ["short", "enospc"])
def test_a_failing_write_leaves_no_torn_record_and_sets_error(journal, tmp_path, monkeypatch,
                                                              caplog, how):
    recs = three_records()
    later = Record(3, "rmdir", 5, b"e")
    journal.append(recs[0])
    failing_write(monkeypatch, how, times=2)
    journal.append(recs[1])
    assert journal.error is not None and "No space left" in journal.error
    assert on_disk(tmp_path) == recs[:1]                 # torn == 0 checked there too
    assert journal.size == os.path.getsize(tmp_path / JOURNAL)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "cannot write the journal" in errors[0].getMessage()
    journal.append(recs[2])                              # fails again: logged once only
    assert journal.error is not None
    assert on_disk(tmp_path) == recs[:1]
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    journal.append(later)                                # the write works again, but
    assert journal.error is not None                     # records 1 and 2 are still missing
    records = on_disk(tmp_path)
    assert records[0] == recs[0] and records[-1] == later
    assert journal.size == os.path.getsize(tmp_path / JOURNAL)
    journal.applied(3, idle=True)                        # everything is in the backing:
    after = Record(4, "rmdir", 6, b"g")
    journal.append(after)                                # the cut-back makes it whole again
    assert journal.error is None
    assert on_disk(tmp_path) == [after]


def test_a_failing_cut_back_is_redone_by_the_next_append(journal, tmp_path, monkeypatch):
    a, b, c = (Record(s, "unlink", s, b"f%d" % s) for s in (1, 2, 3))
    live = Record(0, DIRTY, 9, b"open")
    journal.append(a)
    journal.applied(1, idle=True)
    journal.live.append(live)
    failing_write(monkeypatch, "short")                  # the live record's write fails
    journal.append(b)
    assert journal.error is not None
    assert journal.idle                                  # the cut-back is not done yet
    assert on_disk(tmp_path) == []
    journal.append(c)
    assert journal.error is None and not journal.idle
    records = on_disk(tmp_path)
    assert records[0] == live and records[-1] == c and a not in records


@pytest.mark.parametrize("idle", [False, True], ids=["appending", "cutting-back"])
def test_a_record_whose_write_failed_is_not_forgotten_when_the_error_clears(
        journal, tmp_path, monkeypatch, idle):
    """Found writing this tier. A failed append drops its record, and the next successful
    append clears ``error``: status then says the journal is fine (``journal_error`` null)
    while it lacks the record of an op the flusher has not applied. A crash then loses that
    op (a close() acknowledged before it, say) and replays later records without it (a file
    into a directory whose mkdir is missing: skipped). docs/status.md: ``journal_error`` is
    what tells that "a daemon crash now would lose what is pending"."""
    a = Record(1, "mkdir", 2, b"d", mode=0o40755, uid=0, gid=0)
    b = record_of("publish", seq=2, ino=3)    # the op whose record failed: not applied
    b.path = b"d/f"
    c = Record(3, "symlink", 4, b"d/l", target=b"f", uid=0, gid=0)
    journal.append(a)
    if idle:
        journal.applied(1, idle=True)       # the next append cuts back first
    failing_write(monkeypatch, "short")
    journal.append(b)
    assert journal.error is not None
    journal.append(c)                          # succeeds; op 2 is still queued (applied <= 1)
    records = on_disk(tmp_path)
    assert b in records or journal.error is not None, (
        "the journal lost the record of op 2, not yet applied, yet reports no error: "
        f"on disk {[(r.seq, r.kind) for r in records]}, error {journal.error!r}")


# -- the direct-writes list ---------------------------------------------------------------

def test_direct_writes_tolerate_a_line_cut_short(tmp_path):
    assert read_direct_writes(str(tmp_path)) == set()
    record_direct_write(str(tmp_path), "ckpt/latest")
    record_direct_write(str(tmp_path), os.fsdecode(b"ckpt/caf\xe9 \"q\"\n"))   # not UTF-8, quotes
    with open(tmp_path / DIRECT, "ab") as f:
        f.write(b'"ckpt/half-writ')                      # the daemon-less writer was killed here
    assert read_direct_writes(str(tmp_path)) == {b"ckpt/latest", b"ckpt/caf\xe9 \"q\"\n"}
    assert os.stat(tmp_path / DIRECT).st_mode & 0o777 == 0o600
    (tmp_path / JOURNAL).write_bytes(HEADER.pack(MAGIC, BS, POOL, b""))
    assert read_leftover(str(tmp_path)).direct == {b"ckpt/latest", b"ckpt/caf\xe9 \"q\"\n"}
    jmod.forget_direct_writes(str(tmp_path))
    jmod.forget_direct_writes(str(tmp_path))            # twice: no error
    assert read_direct_writes(str(tmp_path)) == set()


def test_start_and_finish_recovery(tmp_path):
    write_journal(tmp_path, [three_records()[0].encode()])
    jmod.start_recovery(str(tmp_path))
    assert not (tmp_path / JOURNAL).exists() and (tmp_path / RECOVERING).exists()
    write_journal(tmp_path, [three_records()[1].encode()])   # the new daemon's journal
    jmod.start_recovery(str(tmp_path))                       # a second start keeps the first
    assert read_leftover(str(tmp_path)).records == three_records()[:1]
    jmod.finish_recovery(str(tmp_path))
    jmod.finish_recovery(str(tmp_path))
    assert read_leftover(str(tmp_path)).records == three_records()[1:2]


def test_the_header_names_the_daemon_instance(tmp_path):
    """The next daemon learns from the journal whose temporary files are leftovers."""
    j = Journal(str(tmp_path), BS, POOL, instance="0a1b2c3d4e5f")
    j.append(Record(1, "unlink", 2, b"f"))
    j.close()
    left = read_leftover(str(tmp_path))
    assert left is not None and left.instance == "0a1b2c3d4e5f"
    assert [r.seq for r in left.records] == [1]
