"""The fast WRITE path (acpfs/_fastwrite.c + fastwrite.py) and the daemon's copy settings.

Every other test on the daemon's path (no kernel passthrough) writes through the fast path
too; these check what is particular to it, on that path:
that it is really taken, that it writes exactly what pyfuse3's path writes (same random
pwrite sequence through both), that requests it cannot serve (full cache, write-through)
are passed on, and that it can be switched off. See docs/design.md, "What limits writes".
The extension's second job, readers of cached files with direct_io and shared mmap kept
(the INIT exchange), is checked at the end.
"""

from __future__ import annotations

import mmap
import os
import platform
import random
import subprocess

import pytest



def random_pwrites(path, seed: int, size: int = 24 << 20, count: int = 300) -> bytes:
    """Apply random writes (unaligned, overlapping, past the end, 1 B to 3 MiB) to a new
    file; return the content they should leave."""
    rnd = random.Random(seed)
    model = bytearray()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(count):
            n = rnd.choice([1, 7, 4096, 65535, 65536, 65537, 1 << 20, 3 << 20, rnd.randrange(1, 200_000)])
            off = rnd.randrange(0, size)
            data = rnd.randbytes(n)
            assert os.pwrite(fd, data, off) == n
            if len(model) < off + n:
                model.extend(bytes(off + n - len(model)))
            model[off:off + n] = data
    finally:
        os.close(fd)
    return bytes(model)


DAEMON_PATH = {"ACPFS_PASSTHROUGH": "off"}   # the fast path is the daemon's: no passthrough


def test_fast_path_is_taken_and_exact(make_mount):
    mnt = make_mount("fw", env=DAEMON_PATH)
    want = random_pwrites(mnt.mnt / "f", seed=1)
    assert (mnt.mnt / "f").read_bytes() == want
    st = mnt.status()["fast_write"]
    assert st["on"] is True, st   # ./tools/setup builds the extension
    assert st["fast_writes"] >= 300 and st["passed_on"] == 0 and st["failed"] == 0
    mnt.sync()
    assert (mnt.back / "f").read_bytes() == want


# Without the extension there is no passthrough either: such a mount takes the daemon's
# path even where passthrough is insisted on (ACPFS_PASSTHROUGH=on, as CI runs the suite)
NO_EXTENSION = {"ACPFS_NO_FAST_WRITE": "1", "ACPFS_PASSTHROUGH": "auto"}


def test_switched_off_writes_the_same(make_mount):
    m = make_mount("off", env=NO_EXTENSION)
    assert m.status()["passthrough"] == {
        "on": False, "why_not": "the C extension acpfs.fuse._fastwrite is not loaded"}
    st = m.status()["fast_write"]
    assert st == {"on": False, "why_not": "disabled by ACPFS_NO_FAST_WRITE",
                  "non_temporal_threshold": (256 << 10) if platform.machine() == "x86_64" else None,
                  "readers_direct_io": False,   # the extension is not loaded at all
                  "writers_direct_io": False}
    assert "fast write path off: disabled by ACPFS_NO_FAST_WRITE" in m.log.read_text()
    want = random_pwrites(m.mnt / "f", seed=1)
    assert (m.mnt / "f").read_bytes() == want
    m.sync()
    assert (m.back / "f").read_bytes() == want


def test_full_cache_is_passed_on(make_mount):
    """A 96 MiB file through a 32 MiB cache: the writes that find the cache full, or the file
    being written through, go to pyfuse3's async path, which waits for space or spills."""
    m = make_mount("full", cache_size="32M", env=DAEMON_PATH)
    src = m.root / "src"
    src.write_bytes(random.Random(2).randbytes(96 << 20))
    subprocess.run(["dd", f"if={src}", f"of={m.mnt / 'big'}", "bs=1M"], check=True, capture_output=True)
    st = m.status()["fast_write"]
    assert st["on"] is True, st
    assert st["passed_on"] > 0 and st["fast_writes"] > 0 and st["failed"] == 0
    m.sync()
    assert (m.back / "big").read_bytes() == src.read_bytes()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 glibc tunable")
def test_daemon_copies_with_non_temporal_stores(make_mount):
    def threshold(m) -> int | None:
        return m.status()["fast_write"]["non_temporal_threshold"]
    assert threshold(make_mount("nt")) == 256 << 10
    # the user's other tunables are kept, and so is their own threshold
    m2 = make_mount("nt2", env={"GLIBC_TUNABLES": "glibc.malloc.perturb=0"})
    assert threshold(m2) == 256 << 10
    m3 = make_mount("nt3", env={"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x100000"})
    assert threshold(m3) == 1 << 20
    # read as glibc reads it (octal here), and never a loop of reruns when it is not a number
    m4 = make_mount("nt4", env={"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0400000"})
    assert threshold(m4) == 0o400000
    m5 = make_mount("nt5", env={"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=lots"})
    assert threshold(m5) is None


def kernel_maps_direct_io_safely() -> bool:
    """FUSE_DIRECT_IO_ALLOW_MMAP exists from Linux 6.6; acpfs asks for it from 6.9, where
    writable shared mappings of direct_io files work (acpfs/_fastwrite.c)."""
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 9)


@pytest.mark.parametrize("off", [False, True], ids=["direct", "page-cache"])
def test_readers_skip_the_page_cache_and_mmap_still_works(make_mount, off):
    """Readers of a cached file get direct_io where the INIT reply could grant shared mmap
    of direct_io files; reads, shared mappings (read-only, and writable by a writer) and
    the persisted bytes are the same either way."""
    m = make_mount("rd", env={"ACPFS_NO_READ_DIRECT_IO": "1"} if off else None)
    data = bytearray(os.urandom(3 << 20) + b"tail")
    (m.mnt / "f").write_bytes(data)
    direct = m.status()["fast_write"]["readers_direct_io"]
    assert direct is (kernel_maps_direct_io_safely() and not off)
    with open(m.mnt / "f", "rb", buffering=0) as f:
        assert f.read() == data
        f.seek(12345)
        assert f.read(777_777) == data[12345:12345 + 777_777]
    fd = os.open(m.mnt / "f", os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            assert mm[:] == data
    finally:
        os.close(fd)
    fd = os.open(m.mnt / "f", os.O_RDWR)    # a writer's file maps shared either way
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED) as mm:
            mm[5:9] = b"MMAP"
            mm.flush()
        data[5:9] = b"MMAP"
    finally:
        os.close(fd)
    assert (m.mnt / "f").read_bytes() == data
    m.sync()
    assert (m.back / "f").read_bytes() == data


@pytest.mark.parametrize("env", [None, {"ACPFS_NO_READ_DIRECT_IO": "1"}, NO_EXTENSION],
                         ids=["default", "no-read-direct-io", "no-fast-write"])
def test_shared_writable_mappings_work_in_every_mode(make_mount, env):
    """(Shared writable mappings must work on every kernel.) Without the INIT grant of shared
    mmap for direct_io files (kernels before 6.9, or either switch here), a writer's file had
    direct_io and could not be mapped shared: SQLite's WAL failed with "disk I/O error",
    np.memmap(mode="w+") with ENODEV. Files get direct_io only where the grant came; SQLite in
    WAL mode and np.memmap work, and their bytes reach the backing, in every mode."""
    import sqlite3

    import numpy as np
    m = make_mount("map", env=env)
    st = m.status()["fast_write"]
    assert st["writers_direct_io"] is (kernel_maps_direct_io_safely() and env is None)
    arr = np.memmap(m.mnt / "arr.bin", dtype="float32", mode="w+", shape=(300_000,))
    arr[:] = np.arange(300_000, dtype="float32")
    arr.flush()
    del arr
    arr = np.memmap(m.mnt / "arr.bin", dtype="float32", mode="r+", shape=(300_000,))
    arr[1000:2000] = -1.0
    arr.flush()
    del arr
    want = np.arange(300_000, dtype="float32")
    want[1000:2000] = -1.0
    db = sqlite3.connect(m.mnt / "db.sqlite")
    assert db.execute("pragma journal_mode=wal").fetchone()[0] == "wal"
    db.execute("create table t (k integer primary key, v blob)")
    for i in range(20):
        with db:
            db.executemany("insert into t values (?, ?)",
                           [(i * 100 + j, os.urandom(500)) for j in range(100)])
    rows = db.execute("select k, v from t order by k").fetchall()
    db.close()                                   # checkpoints the WAL into the database
    assert np.array_equal(np.fromfile(m.mnt / "arr.bin", dtype="float32"), want)
    m.sync()
    assert np.array_equal(np.fromfile(m.back / "arr.bin", dtype="float32"), want)
    back = sqlite3.connect(f"file:{m.back / 'db.sqlite'}?mode=ro", uri=True)
    assert back.execute("select k, v from t order by k").fetchall() == rows
    assert back.execute("pragma integrity_check").fetchone()[0] == "ok"
    back.close()
