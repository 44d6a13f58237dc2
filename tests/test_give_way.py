"""The flusher gives way to requests (acpfs/flusher/giveway.py; docs/design.md, "The flusher
gives way to requests"), on a real mount: during a burst of created files it waits while
requests arrive, within its share of each second, and everything the burst wrote is
persisted, whole; a program that never pauses does not keep a sync from finishing."""

from __future__ import annotations

import os
import threading
import time

from conftest import Mount


def test_a_burst_of_created_files_is_given_way_and_then_persisted_whole(make_mount):
    m: Mount = make_mount()
    (m.mnt / "burst").mkdir()
    before = m.status()["gave_way_to_requests"]
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < 2.0:
        with open(m.mnt / "burst" / f"f{n}", "wb") as f:
            f.write(n.to_bytes(4, "little") * 1024)
        n += 1
    elapsed = time.monotonic() - start
    after = m.status()["gave_way_to_requests"]
    waits, given = after["waits"] - before["waits"], after["given_s"] - before["given_s"]
    assert waits > 0, (n, after)
    # never more than half of each second that began meanwhile (and one step over each)
    assert given <= 0.5 * (int(elapsed) + 2) + 0.05, (given, elapsed, after)
    m.sync()
    for i in range(n):
        assert (m.back / "burst" / f"f{i}").read_bytes() == i.to_bytes(4, "little") * 1024, i


def test_requests_without_a_pause_do_not_keep_a_sync_from_finishing(make_mount):
    """A program asks for an xattr without a pause (each one answered in Python) while 200
    files are synced: the flusher gives way half of each second at most, so the sync ends."""
    m: Mount = make_mount()
    (m.mnt / "d").mkdir()
    stop = threading.Event()
    asked = [0]

    def ask() -> None:
        while not stop.is_set():
            try:
                os.getxattr(m.mnt / "d", "user.nothing")
            except OSError:
                pass
            asked[0] += 1
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    try:
        time.sleep(0.2)
        for i in range(200):
            (m.mnt / "d" / f"f{i}").write_bytes(b"%d" % i)
        m.sync(timeout=120)
        gave = m.status()["gave_way_to_requests"]
    finally:
        stop.set()
        t.join()
    assert asked[0] > 100 and gave["waits"] > 0, (asked, gave)
    assert sorted(os.listdir(m.back / "d"), key=lambda s: int(s[1:])) == [f"f{i}" for i in range(200)]
    for i in range(200):
        assert (m.back / "d" / f"f{i}").read_bytes() == b"%d" % i
