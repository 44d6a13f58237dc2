"""Databases on the mount: files opened for reading and writing at once get the kernel's page
cache on the daemon's path (``Handles._page_cache``; docs/design.md, "Files opened for reading
and writing keep the page cache"), so SQLite's read of its header at every transaction, and
its fstat, stay in the kernel.

Real programs: Python's sqlite3 in two processes at once, in both journal modes; the
coherence of one file open several ways at once (read-write, write-only, read-only, a shared
mapping); another node's version read at the next open.
"""

from __future__ import annotations

import mmap
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from conftest import content, digest

WRITER = textwrap.dedent("""
    import sqlite3, sys
    con = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
    for i in range(int(sys.argv[2])):
        con.execute("INSERT INTO t (v) VALUES (?)", (b"w" * 200,))
    con.close()
""")

READER = textwrap.dedent("""
    import sqlite3, sys
    con = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
    last = 0
    for _ in range(int(sys.argv[2])):
        n = con.execute("SELECT count(*) FROM t").fetchone()[0]
        assert n >= last, (n, last)
        last = n
    print(last)
""")


def rows(path) -> tuple[int, str]:
    con = sqlite3.connect(path)
    try:
        return (con.execute("SELECT count(*) FROM t").fetchone()[0],
                con.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        con.close()


@pytest.mark.parametrize("mode", ["delete", "wal"])
def test_two_processes_share_a_database_and_it_lands_whole(make_mount, mode):
    """One process inserts 200 rows in single-row transactions while another counts them
    over and over: the count never goes back, ends at 200, the database checks whole, and
    after `acpfs sync` the backing's copy holds the same. Point queries afterwards reach the
    daemon almost never: the header and the pages come from the page cache."""
    m = make_mount(extra=("--coherence-timeout", "30"))
    db = m.mnt / f"app-{mode}.db"
    con = sqlite3.connect(db, isolation_level=None)
    assert con.execute(f"PRAGMA journal_mode={mode}").fetchone()[0] == mode
    con.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB)")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(db), "200"])
    reader = subprocess.run([sys.executable, "-c", READER, str(db), "300"], capture_output=True,
                            text=True, timeout=300)
    assert writer.wait(timeout=300) == 0
    assert reader.returncode == 0, reader.stderr
    assert rows(db) == (200, "ok")
    queries_stay_in_the_kernel(m, con)
    con.close()
    m.sync()
    assert rows(m.back / db.name) == (200, "ok")
    # opened again, with a size known (a writer the kernel could pass through): the same
    con = sqlite3.connect(db, isolation_level=None)
    queries_stay_in_the_kernel(m, con)
    con.close()


def queries_stay_in_the_kernel(m, con) -> None:
    """1000 point queries send fewer than 100 READs and GETATTRs to the daemon (those the C
    extension answers count too: each is a round trip)."""
    def sent(st: dict) -> dict:
        return {"read": st["requests"].get("read", 0),
                "getattr": st["requests"].get("getattr", 0)
                + st["answered_in_c"].get("getattr_answered", 0)}
    before = sent(m.status())
    for k in range(1000):
        assert con.execute("SELECT length(v) FROM t WHERE k = ?", (k % 200 + 1,)).fetchone() == (200,)
    after = sent(m.status())
    for kind in ("read", "getattr"):
        n = after[kind] - before[kind]
        assert n < 100, f"1000 point queries sent {n} {kind.upper()} requests to the daemon"


def test_every_open_of_a_file_open_for_reading_and_writing_sees_the_same_bytes(mnt):
    """A file open read-write (page cache) is also opened write-only, read-only and mapped
    shared: each sees the others' writes at once, and the mount and the backing end with
    what was written last."""
    p = mnt.mnt / "f.bin"
    p.write_bytes(b"0" * 16384)
    rw = os.open(p, os.O_RDWR)
    wo = os.open(p, os.O_WRONLY)
    try:
        assert os.pread(rw, 4, 0) == b"0000"
        os.pwrite(wo, b"bbbb", 0)
        assert os.pread(rw, 4, 0) == b"bbbb", "the read-write open kept a stale page"
        ro = os.open(p, os.O_RDONLY)
        try:
            assert os.pread(ro, 4, 0) == b"bbbb"
            os.pwrite(rw, b"rrrr", 4096)
            assert os.pread(ro, 4, 4096) == b"rrrr"
            with mmap.mmap(rw, 16384) as mm:
                mm[8192:8196] = b"mmmm"
                assert os.pread(ro, 4, 8192) == b"mmmm"
                os.pwrite(wo, b"wwww", 8196)
                assert mm[8196:8200] == b"wwww"
        finally:
            os.close(ro)
        os.ftruncate(rw, 10000)
        assert os.fstat(wo).st_size == 10000
    finally:
        os.close(rw)
        os.close(wo)
    want = b"bbbb" + b"0" * 4092 + b"rrrr" + b"0" * 4092 + b"mmmmwwww" + b"0" * 1800
    assert p.read_bytes() == want
    mnt.sync()
    assert (mnt.back / "f.bin").read_bytes() == want


def test_a_database_another_node_changed_is_read_anew_at_the_next_open(make_nodes, workers):
    """A reads a file through a read-write open (its pages in A's page cache) and closes it;
    B writes a new version and syncs; A's next read-write open reads B's version, not the
    pages it had."""
    a, b = make_nodes(2, extra=("--coherence-timeout", "3600"))
    _, wb = workers(a, b)
    a.path("db").write_bytes(content("a", 10))
    a.sync()
    fd = os.open(a.path("db"), os.O_RDWR)
    try:
        assert os.pread(fd, 1 << 20, 0) == content("a", 10)
    finally:
        os.close(fd)
    wb.do("write", "db", "b", 10)
    b.sync()
    fd = os.open(a.path("db"), os.O_RDWR)
    try:
        got = os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)
    assert digest(got) == digest(content("b", 10)), "A read the pages of the version it had"
