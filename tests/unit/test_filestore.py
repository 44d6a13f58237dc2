"""The memory-file store (acpfs/store/filestore.py) on its own: sharing and copies, accounting,
the bounded set of open descriptors, and what a crash leaves for recovery."""

from __future__ import annotations

import os

import pytest

from acpfs.store import filestore
from acpfs.store.api import CacheFull
from acpfs.store.filestore import MemFiles

PAGE = filestore.PAGE


def test_shared_content_is_never_written_in_place(tmp_path):
    s = MemFiles(str(tmp_path), 64 * PAGE)
    a = s.write(s.empty(), 0, b"v1" * 1000)
    snap = s.share(a)                       # an upload holds it
    assert s.shared(a)
    b = s.write(a, 0, b"XX")                # a writer's change: on a copy
    assert b is not a and not s.shared(b)
    assert s.read(snap, 0, 4) == b"v1v1" and s.read(b, 0, 4) == b"XXv1"
    t = s.truncate(s.share(b), 2000, 10)    # shared again, then cut: the holder keeps 2000
    assert s.read(b, 0, 2000) == b"XX" + b"v1" * 999
    assert s.read(t, 0, 100) == b"XXv1v1v1v1"
    copy = s.copy(t, 10)                    # a snapshot of a file the kernel still writes
    s.write(t, 0, b"zz")
    assert s.read(copy, 0, 10) == b"XXv1v1v1v1"
    for c in (snap, b, t, copy):
        s.drop(c)
    assert sorted(os.listdir(tmp_path / "files")) == []   # every file went with its last holder
    assert s.used == 0
    s.close()


def test_alloc_respects_the_limit_and_used_follows_the_files(tmp_path):
    s = MemFiles(str(tmp_path), 16 * PAGE)
    c = s.alloc(10 * PAGE)
    assert s.used == 10 * PAGE and s.free_bytes() == 6 * PAGE
    with pytest.raises(CacheFull):
        s.alloc(7 * PAGE)
    s.drop(c)
    d = s.empty()
    os.pwrite(s._fd(d), b"k" * (3 * PAGE), 0)      # as the kernel writes it (passthrough)
    assert s.used == 0                               # not seen yet
    assert s.sync(d).st_size == 3 * PAGE and s.used == 3 * PAGE
    s.drop(d)
    s.close()


def test_descriptors_stay_bounded_with_many_files(tmp_path, monkeypatch):
    monkeypatch.setattr(filestore, "OPEN_FDS", 8)
    s = MemFiles(str(tmp_path), 1 << 30)
    before = len(os.listdir("/proc/self/fd"))
    files = [s.write(s.empty(), 0, b"%d" % i) for i in range(100)]
    assert len(os.listdir("/proc/self/fd")) <= before + 8
    assert [s.read(f, 0, 3) for f in files[:3]] == [b"0", b"1", b"2"]   # reopened by name
    with s.source(files[50], 2) as (fd, extents):
        assert list(extents) == [(0, 0, 2)] and os.pread(fd, 2, 0) == b"50"
    for f in files:
        s.drop(f)
    assert os.listdir(tmp_path / "files") == []
    s.close()


def test_a_restart_claims_what_the_journal_names_and_removes_the_rest(tmp_path):
    s = MemFiles(str(tmp_path), 1 << 20)
    kept = s.write(s.empty(), 0, b"acknowledged")
    gone = s.write(s.empty(), 0, b"not named")
    refs = [s.ref(kept), s.ref(kept), []]        # two records of one file, one written through
    s.close()                                    # the daemon dies: files stay
    r = MemFiles(str(tmp_path), 1 << 20)
    r.claim_refs(refs)
    assert os.listdir(tmp_path / "files") == [str(kept.id)]
    c = r.adopt(refs[0])
    assert r.read(c, 0, 12) == b"acknowledged" and c.refs == 2
    assert r.empty().id > max(kept.id, gone.id)   # ids never reused
    r.close()
    r2 = MemFiles(str(tmp_path), 1 << 20)
    with pytest.raises(OSError, match="gone"):
        r2.claim_refs([[9999]])
    r2.close()


# -- fills of the cache in ranges (store.api.in_ranges) -------------------------------------

def test_ranges_cover_a_file_once_each_with_streams_only_for_a_slow_backing(monkeypatch):
    import threading
    import time as time_mod

    from acpfs.store import api
    monkeypatch.setattr(api, "FILL_CHUNK", 1 << 20)
    monkeypatch.setattr(api, "PROBE", 256 << 10)   # timed alone first: small
    for slow in (False, True):
        seen: list[tuple[int, int]] = []
        threads: set[str] = set()

        def copy(off: int, n: int) -> None:
            if slow:
                time_mod.sleep(0.02)     # 1 MiB in 20 ms: 50 MB/s, a network's round trips
            seen.append((off, n))
            threads.add(threading.current_thread().name)
        size = 10 * (1 << 20) + 123
        api.in_ranges(size, copy, unit=4096)
        assert seen[0] == (0, 256 << 10), "the probe first, alone"
        rest = range(256 << 10, size, 1 << 20)
        assert sorted(seen) == [(0, 256 << 10)] + [(off, min(1 << 20, size - off)) for off in rest]
        assert (len(threads) > 1) == slow, threads


def test_an_error_in_one_range_stops_the_fill_and_reaches_the_caller(monkeypatch):
    import time as time_mod

    from acpfs.store import api
    monkeypatch.setattr(api, "FILL_CHUNK", 1 << 20)

    def copy(off: int, n: int) -> None:
        time_mod.sleep(0.01)
        if off == 5 << 20:
            raise OSError(5, "backing failed")
    with pytest.raises(OSError, match="backing failed"):
        api.in_ranges(20 << 20, copy)


def test_copy_range_copies_at_the_same_offsets_across_filesystems(tmp_path):
    from acpfs.store.api import copy_range
    src = tmp_path / "src"
    data = os.urandom(3 << 20)
    src.write_bytes(data)
    dst = "/dev/shm/acpfs-test-copy-range"    # tmpfs: copy_file_range refuses (EXDEV)
    s = os.open(src, os.O_RDONLY)
    d = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(d, len(data))
        copy_range(s, d, 1 << 20, 1 << 20)
        copy_range(s, d, 0, 1 << 20)
        copy_range(s, d, 2 << 20, 5 << 20)   # past the end: stops there
        assert os.pread(d, len(data), 0) == data
    finally:
        os.close(s)
        os.close(d)
        os.unlink(dst)
