"""Requests that meet a written-through file (too large for the cache, its content staged in
the backing) while its staging file is being cut, copied or published.

A slow backing holds each window open for real: the backing is ``tests/faultfs.py``, told to
hang one kind of request (``hang setattr`` holds every ftruncate of a staging file, ``hang
rename`` holds the publish) while the test's other program acts. Before these were fixed,
a truncate racing the last writer's close handed one staging file to the flusher twice (it
then retried forever: ``acpfs sync`` never returned), and openers woken together by a
publish each staged a copy, one of them getting ENOENT.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import staged_files
from faultfs import Shim

MiB = 1 << 20


class Mounted:
    """acpfs (8 MiB cache, so a 12 MiB file is written through) over faultfs over SOURCE."""

    def __init__(self, make_mount, tmp_path: Path) -> None:
        self.m = make_mount("r", cache_size="8M", mount=False)
        self.src = tmp_path / "src"
        self.src.mkdir()
        self.shim = Shim(self.src, self.m.back, tmp_path / "faultfs.ctl")
        try:
            self.m.mount()
        except BaseException:
            self.shim.close()
            raise

    def close(self) -> None:
        try:
            self.shim.set("ok")
            self.m.cleanup()     # drains into the repaired backing first
        finally:
            self.shim.close()


@pytest.fixture
def rig(make_mount, tmp_path):
    r = Mounted(make_mount, tmp_path)
    yield r
    r.close()


class Call(threading.Thread):
    """Run fn in a thread; ``result()`` re-raises what it raised."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:   # noqa: BLE001  re-raised in result()
            self.error = e

    def result(self, timeout: float = 60):
        self.join(timeout)
        assert not self.is_alive(), "call did not return"
        if self.error is not None:
            raise self.error
        return self.value


def written_through(rig: Mounted, data: bytes, name: str = "big") -> int:
    """Open NAME for writing and write DATA (larger than the cache); returns the descriptor."""
    fd = os.open(rig.m.mnt / name, os.O_WRONLY | os.O_CREAT, 0o644)
    assert os.write(fd, data) == len(data)
    staged = [p.stat().st_size for p in staged_files(rig.src)]
    assert staged == [len(data)], staged
    return fd


def blocked(call: Call) -> None:
    time.sleep(0.5)
    assert call.is_alive(), "the request did not wait for the hung backing"


def test_truncate_by_path_while_the_last_writer_closes(rig):
    data = os.urandom(12 * MiB)
    fd = written_through(rig, data)
    try:
        rig.shim.set("hang setattr")
        cut = Call(lambda: os.truncate(rig.m.mnt / "big", MiB))   # cuts the staging file: hangs
        blocked(cut)
    finally:
        os.close(fd)          # the last writer's release would hand the file over now
    time.sleep(0.5)
    rig.shim.set("ok")
    cut.result()
    rig.m.sync(timeout=60)    # one publish of the cut file (it used to be queued twice)
    assert (rig.src / "big").read_bytes() == data[:MiB]
    assert (rig.m.mnt / "big").read_bytes() == data[:MiB]
    assert rig.m.status()["errors"] == []


def test_open_trunc_while_the_last_other_writer_closes(rig):
    (rig.m.mnt / "big").write_bytes(b"v0")
    rig.m.sync()
    data = os.urandom(12 * MiB)
    fd = written_through(rig, data)
    try:
        rig.shim.set("hang setattr")
        second = Call(lambda: os.open(rig.m.mnt / "big", os.O_WRONLY | os.O_TRUNC))
        blocked(second)
    finally:
        os.close(fd)
    time.sleep(0.5)
    rig.shim.set("ok")
    fd2 = second.result()
    try:
        rig.m.sync(timeout=60)
        # never the first writer's length in zeros: its staging file was being cut to 0
        back = (rig.src / "big").read_bytes()
        assert back in (b"v0", data), f"{len(back)} bytes {back[:16]!r}"
        assert os.write(fd2, b"new") == 3
    finally:
        os.close(fd2)
    rig.m.sync(timeout=60)
    assert (rig.src / "big").read_bytes() == b"new"
    assert rig.m.status()["errors"] == []


def test_writers_opening_a_written_through_file_as_it_is_published(rig):
    data = bytearray(os.urandom(12 * MiB))
    fd = written_through(rig, bytes(data))
    rig.shim.set("hang rename")
    os.close(fd)              # its publish (ending in a rename) is queued, and held
    time.sleep(0.3)

    def writer(i: int):
        def run():
            fd = os.open(rig.m.mnt / "big", os.O_RDWR)   # waits for the publish, then stages
            try:
                return os.pwrite(fd, b"writer %d" % i, i * MiB)
            finally:
                os.close(fd)
        return run
    calls = [Call(writer(i)) for i in range(3)]
    blocked(calls[0])
    rig.shim.set("ok")
    for i, c in enumerate(calls):
        assert c.result() == 8
        data[i * MiB:i * MiB + 8] = b"writer %d" % i
    rig.m.sync(timeout=60)
    assert (rig.src / "big").read_bytes() == data
    assert (rig.m.mnt / "big").read_bytes() == data
    assert rig.m.status()["errors"] == []
