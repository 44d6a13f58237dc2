"""Files the cache does not hold (a resume on a node that did not write the checkpoint):
read by the kernel from the backing file itself (core/coldreads.py), the version each open
revalidated, beside writers of the same file, other nodes' new versions and a cache smaller
than the file.

These run on the data path a mount chooses. With passthrough (root, Linux 6.9+, as CI runs
the suite first) the reads must not reach the daemon; on the daemon's path
(./tools/test-daemon-path) the same answers come through the daemon.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from acpfs import mounttable
from conftest import ACPFS, acpfs, wait_for


def passthrough_on(m) -> bool:
    return m.status()["passthrough"]["on"]


def reads(m) -> int:
    return m.status()["requests"].get("read", 0)


def over_faultfs(make_mount, faults, tmp_path):
    """A mount (256 MiB cache) whose backing is a faultfs mirror of ``src``: (mount, src,
    the faultfs shim, which counts what it serves and can be slowed)."""
    m = make_mount(cache_size="256M", mount=False)
    src = tmp_path / "src"
    shim = faults.shim(src, m.back)
    faults.mount(m)
    return m, src, shim


def put(m, rel: str, data: bytes) -> None:
    """A file written into the backing by another program (or node), replaced atomically."""
    tmp = m.back / (rel + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, m.back / rel)


def test_an_uncached_file_is_read_and_mapped_by_the_kernel_from_its_backing_file(mnt):
    data = random.Random(3).randbytes(24 << 20)
    put(mnt, "ckpt.bin", data)
    before = mnt.status()
    assert (mnt.mnt / "ckpt.bin").read_bytes() == data
    with open(mnt.mnt / "ckpt.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert hashlib.sha256(mm).digest() == hashlib.sha256(data).digest()
        assert os.fstat(f.fileno()).st_ino == os.stat(mnt.mnt / "ckpt.bin").st_ino
    subprocess.run(["dd", f"if={mnt.mnt / 'ckpt.bin'}", "of=/dev/null", "bs=1M", "status=none"],
                   check=True)
    after = mnt.status()
    assert after["cold_reads"]["opened"] >= before["cold_reads"]["opened"] + 1
    assert after["cold_reads"]["opens"] == 0, after["cold_reads"]
    if passthrough_on(mnt):
        assert reads(mnt) == before["requests"].get("read", 0), "a READ reached the daemon"
    else:
        assert reads(mnt) > before["requests"].get("read", 0)


def test_a_writer_opens_a_file_that_readers_hold_open_and_mapped(mnt):
    """The kernel's one-backing-file-per-inode rule: the writer gets its own kernel inode
    (no EIO), writes as on any file, and the readers keep the version they opened."""
    old = random.Random(4).randbytes(8 << 20)
    put(mnt, "w.bin", old)
    path = mnt.mnt / "w.bin"
    readers = [open(path, "rb") for _ in range(3)]
    try:
        maps = [mmap.mmap(r.fileno(), 0, prot=mmap.PROT_READ) for r in readers[:2]]
        assert readers[2].read(4096) == old[:4096]
        ino = os.fstat(readers[0].fileno()).st_ino
        with open(path, "r+b") as w:      # an open for writing: no EIO
            w.seek(4096)
            w.write(b"N" * 4096)
            assert os.fstat(w.fileno()).st_ino == ino, "one file, one st_ino"
        with open(path, "rb") as r2:      # a new reader: the new version
            assert r2.read(8192) == old[:4096] + b"N" * 4096
        # the readers that opened before keep the version they opened, read and mapped
        assert readers[2].read(4096) == old[4096:8192]
        assert all(m[4096:8192] == old[4096:8192] for m in maps)
        for m in maps:
            m.close()
        mnt.sync()
        assert (mnt.back / "w.bin").read_bytes()[:8192] == old[:4096] + b"N" * 4096
        assert readers[0].read() == old
    finally:
        for r in readers:
            r.close()
    # truncated and rewritten whole by a new writer while nothing is open: as on any file
    path.write_bytes(b"short")
    assert path.read_bytes() == b"short"
    assert os.stat(path).st_ino == ino


def test_a_version_another_node_published_is_read_at_the_next_open(make_mount):
    m = make_mount(extra=("--coherence-timeout", "0.2"))
    put(m, "latest.pt", b"A" * (1 << 20))
    holder = open(m.mnt / "latest.pt", "rb")
    try:
        assert holder.read(4) == b"AAAA"
        put(m, "latest.pt", b"B" * (2 << 20))     # another node's new version
        wait_for(lambda: (m.mnt / "latest.pt").read_bytes() == b"B" * (2 << 20), timeout=20,
                 what="the new version at a new open")
        assert holder.read() == b"A" * ((1 << 20) - 4), "the old open keeps its version"
    finally:
        holder.close()
    assert (m.mnt / "latest.pt").read_bytes() == b"B" * (2 << 20)


@pytest.mark.parametrize("calls", ["auto", "threads"])
def test_a_local_backing_is_asked_on_the_event_loop_and_a_remote_one_in_threads(make_mount, faults,
                                                                               tmp_path, calls):
    """--backing-calls: lookups and opens of files another program put in a local backing
    ask it on the daemon's event loop (auto), or in worker threads (threads, and always over
    a FUSE backing, which may wait for a server); either way each open reads the version it
    revalidated."""
    m = make_mount("local", extra=("--backing-calls", calls))
    for i in range(20):
        put(m, f"f{i}", bytes([i]) * 65536)
    for i in range(20):
        assert (m.mnt / f"f{i}").read_bytes() == bytes([i]) * 65536
    put(m, "f0", b"new")
    wait_for(lambda: (m.mnt / "f0").read_bytes() == b"new", 20, "the new version at a new open")
    bc = m.status()["backing_calls"]
    text = acpfs("status", str(m.mnt)).stdout
    if calls == "auto":
        assert bc["where"] == "inline" and bc["fstype"] == mounttable.fstype_of(str(m.back))
        assert bc["inline"] >= 20 and bc["inline"] > bc["threaded"], bc
        assert f"on the event loop ({bc['fstype']}, a local filesystem)" in text
    else:
        assert bc == {"where": "threads", "fstype": None, "inline": 0, "threaded": bc["threaded"]}
        assert bc["threaded"] >= 20 and "on the event loop" not in text
    if calls == "threads":
        return
    r, src, shim = over_faultfs(make_mount, faults, tmp_path)
    (src / "g").write_bytes(b"g" * 4096)
    assert (r.mnt / "g").read_bytes() == b"g" * 4096
    bc = r.status()["backing_calls"]
    assert bc["where"] == "threads" and bc["inline"] == 0 and bc["threaded"] >= 1, bc


def test_a_file_read_from_the_backing_is_kept_and_read_again_from_memory(make_mount, faults, tmp_path):
    """Read once, kept: the backing (faultfs, counting what it serves) sees the file read
    once however many readers open it at once, and not at all when it is read again."""
    m, src, shim = over_faultfs(make_mount, faults, tmp_path)
    data = random.Random(7).randbytes(32 << 20)
    (src / "one.bin").write_bytes(data)
    (src / "eight.bin").write_bytes(data)

    def backing_reads() -> int:
        """Bytes the backing's READs returned so far (the requests split where readers
        meet: they are not the measure)."""
        time.sleep(0.5)    # faultfs writes its counts every 0.1 s
        return shim.counts().get("read_bytes", 0)

    def cached(name: str) -> bool:
        return m.state(name) == "persisted" and m.status()["cache"]["cached_files"] >= 1

    start = backing_reads()
    assert (m.mnt / "one.bin").read_bytes() == data
    wait_for(lambda: cached("one.bin"), 30, "one.bin kept in the cache")
    one = backing_reads() - start
    assert one >= len(data), f"one reader: the backing served {one} bytes of {len(data)}"
    ranks = [subprocess.Popen(["sha256sum", str(m.mnt / "eight.bin")], stdout=subprocess.PIPE)
             for _ in range(8)]
    sums = {r.communicate()[0].split()[0].decode() for r in ranks}
    assert sums == {hashlib.sha256(data).hexdigest()}
    wait_for(lambda: m.status()["cache"]["cached_files"] >= 2, 30, "eight.bin kept too")
    assert m.status()["cold_reads"]["kept"] == 2
    eight = backing_reads() - start - one
    assert eight <= 1.25 * one, f"8 readers made the backing serve {eight} bytes, one reader {one}"
    again = backing_reads()
    for name in ("one.bin", "eight.bin"):
        with open(m.mnt / name, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:] == data
    assert backing_reads() == again, "read again from the cache, not the backing"


def test_a_file_larger_than_the_cache_reads_whole_and_right(make_mount):
    m = make_mount(cache_size="64M")
    data = random.Random(5).randbytes(160 << 20)
    put(m, "big.bin", data)
    h = hashlib.sha256()
    with open(m.mnt / "big.bin", "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    assert h.digest() == hashlib.sha256(data).digest()
    with open(m.mnt / "big.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[-(1 << 20):] == data[-(1 << 20):]
    assert m.status()["cache"]["used_bytes"] <= 64 << 20


def test_reads_the_daemon_serves_come_from_the_page_cache_at_once_and_from_the_disk_in_threads(
        make_mount):
    """The daemon's path: a READ of a backing file is answered at once where the backing's
    page cache holds all of it (``Handles.read_now``), and in a worker thread where some of it
    is not (RWF_NOWAIT reads a part, which must never be answered as the end of the file).
    Random reads against the bytes, with random ranges dropped from the page cache between
    them; the file is larger than half the cache, so it is never kept and every read is of
    the backing file."""
    m = make_mount(cache_size="64M")
    if passthrough_on(m):
        pytest.skip("passthrough: the kernel reads a file the cache does not hold itself")
    rng = random.Random(11)
    size = (40 << 20) + 12345
    data = rng.randbytes(size)
    put(m, "r.bin", data)
    back = os.open(m.back / "r.bin", os.O_RDONLY)
    os.fsync(back)   # the page cache drops clean pages only
    fd = os.open(m.mnt / "r.bin", os.O_RDONLY)
    try:
        before = m.status()["at_once"]["read"]
        for step in range(120):
            if step % 10 == 0:   # some of the file leaves the backing's page cache
                off = rng.randrange(0, size, 4096)
                os.posix_fadvise(back, off, rng.randrange(1, 8 << 20), os.POSIX_FADV_DONTNEED)
            off = rng.choice([rng.randrange(size), size - rng.randrange(1, 3 << 20)])
            n = rng.choice([1, 4096, 131072, 1 << 20, 3 << 20])
            assert os.pread(fd, n, off) == data[off:off + n], (step, off, n)
        assert os.pread(fd, 10, size) == b""
        after = m.status()["at_once"]["read"]
    finally:
        os.close(fd)
        os.close(back)
    assert after["answered"] > before["answered"], after
    assert after["passed"] > before["passed"], after   # the dropped ranges: in threads
    assert after["failed"] == before["failed"], after


def test_many_readers_of_one_cold_file_share_one_backing_file(mnt):
    data = random.Random(6).randbytes(4 << 20)
    put(mnt, "shared.bin", data)
    files = [open(mnt.mnt / "shared.bin", "rb") for _ in range(8)]
    try:
        st = mnt.status()
        assert st["cold_reads"]["files"] == 1 and st["cold_reads"]["opens"] == 8, st["cold_reads"]
        out = subprocess.run([*ACPFS, "status", str(mnt.mnt)], capture_output=True, text=True,
                             check=True).stdout
        assert "  uncached   1 files read from the backing" in out and "(8 opens;" in out, out
        assert all(f.read() == data for f in files)
    finally:
        for f in files:
            f.close()
    assert mnt.status()["cold_reads"]["opens"] == 0


@pytest.mark.parametrize("how", ["truncate", "append", "rename_over"])
def test_changes_by_path_while_a_cold_reader_is_open(mnt, how):
    """Changes that do not open the file for writing through the reader's kernel inode."""
    put(mnt, "c.bin", b"x" * 10000)
    path = mnt.mnt / "c.bin"
    with open(path, "rb") as r:
        assert r.read(10) == b"x" * 10
        if how == "truncate":
            os.truncate(path, 100)
            assert os.stat(path).st_size == 100
            assert path.read_bytes() == b"x" * 100
        elif how == "append":
            with open(path, "ab") as a:
                a.write(b"tail")
            assert path.read_bytes() == b"x" * 10000 + b"tail"
        else:
            (mnt.mnt / "new.bin").write_bytes(b"new")
            os.rename(mnt.mnt / "new.bin", path)
            assert path.read_bytes() == b"new"
        assert r.read(10) == b"x" * 10, "the reader keeps the version it opened"
    mnt.sync()
    expect = {"truncate": b"x" * 100, "append": b"x" * 10000 + b"tail", "rename_over": b"new"}[how]
    assert (mnt.back / "c.bin").read_bytes() == expect


def test_preload_reads_a_directory_up_to_a_byte_budget_and_shows_its_rate(make_mount):
    m = make_mount(cache_size="256M")
    (m.back / "ckpt").mkdir()
    data = {f"shard{i}.bin": random.Random(i).randbytes(3 << 20) for i in range(6)}
    for name, d in data.items():
        put(m, f"ckpt/{name}", d)
    before = m.status()
    r = subprocess.run([*ACPFS, "preload", str(m.mnt / "ckpt"), "--max-bytes", "10M"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "preloaded 3 files (9.0 MiB); 3 not read: past --max-bytes 10.0 MiB" in r.stderr, r.stderr
    assert re.search(r"preload: .*3/3 files, 9\.0 MiB of 9\.0 MiB, fetched at .+/s", r.stderr), r.stderr
    after = m.status()
    assert after["cold_reads"]["fetched_bytes"] - before["cold_reads"]["fetched_bytes"] >= 9 << 20
    assert after["cache"]["cached_files"] - before["cache"]["cached_files"] == 3
    for name in ("shard0.bin", "shard1.bin", "shard2.bin"):   # the order given: sorted names
        assert json.loads(os.getxattr(m.mnt / "ckpt" / name, "user.acpfs.preload")) == \
            {"size": 3 << 20, "cached": True}
    assert m.status()["cold_reads"]["fetched_bytes"] == after["cold_reads"]["fetched_bytes"]
    for name, d in data.items():
        assert (m.mnt / "ckpt" / name).read_bytes() == d
    # the rest, then the whole directory again: nothing left to fetch
    r = subprocess.run([*ACPFS, "preload", str(m.mnt / "ckpt")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "preloaded 6 files (18.0 MiB)" in r.stderr, r.stderr
    for bad in ("lots", "-1M"):
        r = subprocess.run([*ACPFS, "preload", str(m.mnt / "ckpt"), "--max-bytes", bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "--max-bytes" in r.stderr and "Traceback" not in r.stderr


def resident(path) -> int:
    """Bytes of ``path`` in the page cache (util-linux fincore)."""
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                       capture_output=True, text=True, check=True)
    return int(r.stdout.split()[0])


def test_a_copy_into_the_cache_drops_the_backing_pages_nobody_reads(mnt):
    """RAM holds one copy of a file copied into the cache: the backing's page cache of what
    was copied goes (docs/design.md, "Reading what the cache does not hold"), except where
    an open of the file reads the backing file itself; a mapping keeps its pages."""
    size = 16 << 20
    data = {n: random.Random(n).randbytes(size) for n in ("alone", "read", "mapped", "kept")}
    for name, d in data.items():
        put(mnt, name, d)
        with open(mnt.back / name, "rb") as f:   # clean in the backing's page cache, as after
            os.fsync(f.fileno())                 # a read there (dirty pages are never dropped)
            f.read()
        assert resident(mnt.back / name) == size
    reader = open(mnt.mnt / "read", "rb")   # reads the backing file (passed through or not)
    try:
        assert reader.read() == data["read"]
        with open(mnt.back / "mapped", "rb") as f:   # another program maps the backing file
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert hashlib.sha256(mapped).digest() == hashlib.sha256(data["mapped"]).digest()
        for name in ("alone", "read", "mapped"):
            assert json.loads(os.getxattr(mnt.mnt / name, "user.acpfs.preload")) == \
                {"size": size, "cached": True}
        assert resident(mnt.back / "alone") <= size // 16, "the backing's copy stayed in RAM"
        assert resident(mnt.back / "read") == size, "dropped under an open reading it"
        assert resident(mnt.back / "mapped") == size, "a mapping lost its pages"
        mapped.close()
    finally:
        reader.close()
    # read through the mount once, then kept after its reader is gone: dropped too
    assert (mnt.mnt / "kept").read_bytes() == data["kept"]
    wait_for(lambda: mnt.state("kept") == "persisted" and not mnt.status()["cold_reads"]["keeping"],
             30, "kept in the cache")
    assert resident(mnt.back / "kept") <= size // 16
    for name, d in data.items():   # every file reads right, from the cache
        assert (mnt.mnt / name).read_bytes() == d
        assert mnt.state(name) == "persisted"


@pytest.mark.parametrize("how", ["preload", "read"])
def test_a_daemon_killed_during_a_fetch_leaves_nothing_wrong(make_mount, faults, tmp_path, how):
    """SIGKILL while a file is copied from a slow backing into the cache (by ``acpfs preload``,
    or kept after a read): the backing copy is untouched and a remount reads the file right."""
    m, src, shim = over_faultfs(make_mount, faults, tmp_path)
    data = random.Random(11).randbytes(64 << 20)
    (src / "big.bin").write_bytes(data)
    # slow enough that the fetch is still under way when it is killed, on a loaded machine too
    shim.set("slow 0.05 read")
    cmd = [*ACPFS, "preload", str(m.mnt / "big.bin")] if how == "preload" else \
        ["dd", f"if={m.mnt / 'big.bin'}", "of=/dev/null", "bs=1M", "status=none"]
    client = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: m.status()["cold_reads"]["fetched_bytes"] > 0, 60, "a fetch under way")
        assert m.status()["cache"]["cached_files"] == 0, "the fetch ended before the kill"
        os.kill(m.pid, signal.SIGKILL)
    finally:
        client.kill()
        client.wait()
    shim.set("ok")
    r = subprocess.run([*ACPFS, *m.args()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "stale mount" in r.stderr, r.stderr
    m.pid = m.status()["pid"]
    assert not (m.status()["recovery"] or {}).get("lost_open_files"), m.status()["recovery"]
    assert hashlib.sha256((m.mnt / "big.bin").read_bytes()).digest() == hashlib.sha256(data).digest()
    assert hashlib.sha256((src / "big.bin").read_bytes()).digest() == hashlib.sha256(data).digest()
    assert sorted(p.name for p in src.iterdir() if not p.name.startswith(".acpfs")) == ["big.bin"]
    assert json.loads(os.getxattr(m.mnt / "big.bin", "user.acpfs.preload")) == \
        {"size": len(data), "cached": True}
    assert (m.mnt / "big.bin").read_bytes() == data


def test_files_kept_after_a_read_make_room_for_writers_least_recently_used_first(make_mount):
    """Read-once copies are clean and evictable: a writer that needs their room gets it at
    once (nothing is written through), the least recently used going first (on passthrough,
    where reads never reach the daemon, the last close of a file is its use)."""
    m = make_mount(cache_size="64M")
    files = {f"r{i}.bin": random.Random(20 + i).randbytes(16 << 20) for i in range(3)}
    for name, d in files.items():
        put(m, name, d)
    for name, d in files.items():
        assert (m.mnt / name).read_bytes() == d
        time.sleep(0.05)
    wait_for(lambda: m.status()["cold_reads"]["kept"] == 3 and m.status()["cold_reads"]["keeping"] == 0,
             60, "the three files kept")
    assert (m.mnt / "r0.bin").read_bytes() == files["r0.bin"]   # r0 read again: r1 is the oldest
    new = random.Random(30).randbytes(24 << 20)
    with open(m.mnt / "w.bin", "wb") as f:
        f.write(new)
    st = m.status()
    assert st["write_through"]["files"] == 0, st["write_through"]
    assert st["cache"]["used_bytes"] <= 64 << 20

    def cold_opens() -> int:   # opens of files the cache does not hold
        return m.status()["cold_reads"]["opened"]
    start = cold_opens()
    assert (m.mnt / "r0.bin").read_bytes() == files["r0.bin"]
    assert (m.mnt / "r2.bin").read_bytes() == files["r2.bin"]
    assert cold_opens() == start, "r0.bin or r2.bin, read later, was evicted before r1.bin"
    assert (m.mnt / "r1.bin").read_bytes() == files["r1.bin"]
    assert cold_opens() == start + 1, "r1.bin, read least recently, was not evicted"
    m.sync()
    assert (m.back / "w.bin").read_bytes() == new


def test_many_small_files_read_from_a_local_backing_are_kept_and_a_held_one_delays_none(mnt):
    """Files read from a local backing are copied in batches once their readers are gone
    (``Fetch._keeper``): every one of 300 small files is kept and then read from memory,
    right; one a reader holds open is kept only after its close, and holds up none of the
    others; one replaced in the backing before its copy is not kept in the old version."""
    files = {f"d/s{i:03}": random.Random(i).randbytes(random.Random(-i).randrange(1, 64 << 10))
             for i in range(300)}
    (mnt.back / "d").mkdir()
    for rel, data in files.items():
        put(mnt, rel, data)
    put(mnt, "held.bin", b"held" * 1000)
    put(mnt, "replaced.bin", b"old" * 1000)
    held = open(mnt.mnt / "held.bin", "rb")
    try:
        assert held.read(4) == b"held"
        assert (mnt.mnt / "replaced.bin").read_bytes() == b"old" * 1000
        put(mnt, "replaced.bin", b"new" * 1000)    # before its copy (a second after the close)
        for rel, data in files.items():
            assert (mnt.mnt / rel).read_bytes() == data
        wait_for(lambda: mnt.status()["cold_reads"]["keeping"] == 1, 60,
                 "every file but the held one kept")
        assert mnt.status()["cold_reads"]["kept"] == 300
    finally:
        held.close()
    wait_for(lambda: mnt.status()["cold_reads"]["keeping"] == 0, 30, "the held file kept")
    st = mnt.status()["cold_reads"]
    assert st["kept"] == 301, st
    opened = st["opened"]
    for rel, data in files.items():
        assert (mnt.mnt / rel).read_bytes() == data
    assert (mnt.mnt / "held.bin").read_bytes() == b"held" * 1000
    assert mnt.status()["cold_reads"]["opened"] == opened, "read again from the backing"
    assert (mnt.mnt / "replaced.bin").read_bytes() == b"new" * 1000


def test_a_readers_close_sends_no_flush_and_still_drops_its_locks(mnt):
    """Opens for reading are answered FOPEN_NOFLUSH (a load opens each file twice: two round
    trips less per file): cat, dd and a mapping loader close without a FLUSH reaching the
    daemon, cached and uncached files alike, while a writer's close still sends one (it
    stamps what it acknowledges). POSIX locks stay the kernel's: a read lock taken on a
    reader's descriptor is gone once it is closed."""
    import fcntl
    put(mnt, "cold.bin", random.Random(40).randbytes(4 << 20))
    (mnt.mnt / "cached.bin").write_bytes(b"c" * 100_000)
    mnt.sync()

    def flushes() -> int:
        return mnt.status()["requests"].get("flush", 0)
    before, noflush = flushes(), mnt.status()["fast_write"].get("noflush_opens", 0)
    for name in ("cold.bin", "cached.bin"):
        subprocess.run(["cat", str(mnt.mnt / name)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["dd", f"if={mnt.mnt / name}", "of=/dev/null", "bs=1M", "status=none"],
                       check=True)
        with open(mnt.mnt / name, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert len(mm) == os.fstat(f.fileno()).st_size
    assert flushes() == before, "a reader's close sent a FLUSH"
    assert mnt.status()["fast_write"]["noflush_opens"] >= noflush + 6
    with open(mnt.mnt / "w.bin", "wb") as f:
        f.write(b"w" * 1000)
    assert flushes() >= before + 1, "a writer's close sent no FLUSH"
    # a read lock on a reader's descriptor ends with its close (the kernel's own locks)
    probe = [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'r+b'); "
             "fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(mnt.mnt / "cached.bin")]
    f = open(mnt.mnt / "cached.bin", "rb")
    fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    assert subprocess.run(probe, capture_output=True).returncode != 0, "the read lock held nothing"
    f.close()
    assert subprocess.run(probe, capture_output=True).returncode == 0, "the lock outlived close()"


def test_the_passthrough_floor_tool_loads_through_a_c_daemon_a_python_daemon_and_acpfs():
    """tools/passthrough_floor.py (docs/benchmarks.md, "The floor of a cold load") builds its C
    daemon, mounts it, its Python twin (tools/passthrough_floor_py.py) and acpfs over one
    directory, loads through all three (every file read through the floors is passed through:
    they have no READ handler) and unmounts them."""
    out = subprocess.run([sys.executable, "tools/passthrough_floor.py", "--size", "8", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    rows = {line[:31].strip(): line[31:].split() for line in out.stdout.splitlines()
            if line.startswith(("torch.load", "np.memmap", "read()"))}
    assert len(rows) == 3, out.stdout
    for name, cells in rows.items():   # ms: direct, C, Python, acpfs; then the three ratios
        assert len(cells) == 7 and all(float(c.rstrip("x")) > 0 for c in cells), (name, cells)
        assert all(c.endswith("x") for c in cells[4:]), (name, cells)
    assert "lookup" in out.stdout.splitlines()[-1] and "open 2.0" in out.stdout, out.stdout
    assert "acpfs-ptfloor" not in open("/proc/mounts").read(), "a mount was left behind"
