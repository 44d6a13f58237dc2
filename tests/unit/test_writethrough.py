"""The full cache under trio: write-through of large open files to staged files in the
backing, reads, writes and truncates of staged files, and ENOSPC (not a deadlock) when the
backing hangs. A 16-block cache (64 KiB) so that it fills with a few writes."""

from __future__ import annotations

import errno
import os
import time

import pytest
import trio

from acpfs.node import FsError
from harness import BS
from triocore import ROOT, close, create, drain, pattern, read, run, write

BLOCKS = 16
CACHE = BLOCKS * BS
TIMEOUT = 0.5      # cache_full_timeout in these tests


@pytest.fixture
def h(make_core):
    return make_core(blocks=BLOCKS)


def staged_files(h) -> list[str]:
    d = h.back / os.fsdecode(h.backing.staging_dir)
    return sorted(os.listdir(d)) if d.exists() else []


def test_a_write_larger_than_the_free_cache_is_written_through(h):
    other = pattern(8 * BS, seed=9)
    data = pattern(CACHE // 2 + 3 * BS + 11)              # 12 blocks, 8 are free

    async def test(core):
        fo, o = await create(core, b"other")
        await write(core, fo, other)
        fh, node = await create(core, b"big")
        t = time.monotonic()
        await write(core, fh, data)
        assert time.monotonic() - t < 0.15                 # at once, not after waiting
        assert node.staged is not None and node.content is None
        assert o.staged is None and h.store.used == 8 * BS   # the other file stays cached
        assert len(staged_files(h)) == 1
        assert node.size == len(data)
        assert await read(core, fh, 2 * CACHE) == data      # read from the staged file
        assert await read(core, fh, 100, off=BS - 50) == data[BS - 50:BS + 50]
        assert await read(core, fh, 10, off=len(data)) == b""
        assert core.handles.write_now(fh, 0, memoryview(b"x")) is None   # staged: never the fast path
        await write(core, fh, b"tail", off=len(data))      # more writes go to the staged file
        assert h.store.used == 8 * BS
        assert not (h.back / "big").exists()                # not published before close
        await close(core, fh)
        await close(core, fo)
        await drain(h)
        assert node.staged is None                          # handed over and published
    run(h, test)
    assert (h.back / "big").read_bytes() == data + b"tail"
    assert (h.back / "other").read_bytes() == other
    assert not (h.back / os.fsdecode(h.backing.staging_dir)).exists()


def test_a_full_cache_writes_the_largest_open_file_through_and_only_it(h):
    """Found writing this tier: fails. ``WriteThrough.with_space`` picks a victim at the top
    of each pass after its sleep, before trying ``fn`` again. When the first victim (a) has
    been written through during that sleep, there is room for b's write, but the pass first
    picks another victim: b itself (its failed write, ``Cache.write`` then, even padded its
    block list with holes, so it ranks as a 6-block candidate), and b, a small file whose
    write now fits, is written through and goes on at the backing's speed."""
    a_data = pattern(12 * BS, seed=1)
    b_data = pattern(6 * BS, seed=2)

    async def test(core):
        fa, a = await create(core, b"a")
        for off in range(0, len(a_data), 3 * BS):          # each write fits: cached
            await write(core, fa, a_data[off:off + 3 * BS], off=off)
        assert a.staged is None and h.store.used == 12 * BS
        fb, b = await create(core, b"b")
        t = time.monotonic()
        await write(core, fb, b_data)                       # needs 6 blocks, 4 are free
        waited = time.monotonic() - t
        assert waited < TIMEOUT                              # no ENOSPC, no long wait
        assert a.staged is not None and a.content is None    # a went to the backing
        await trio.sleep(0.2)                                # nothing else is going on
        assert (b.staged, b.ino in core.wt.slots) == (None, False), "b was written through too"
        assert h.store.used == 6 * BS                       # b is cached
        assert await read(core, fa, CACHE) == a_data
        await write(core, fa, b"more", off=len(a_data))
        await close(core, fa)
        await close(core, fb)
        await drain(h)
    run(h, test, cache_full_timeout=TIMEOUT)
    assert (h.back / "a").read_bytes() == a_data + b"more"
    assert (h.back / "b").read_bytes() == b_data
    assert staged_files(h) == []


@pytest.mark.parametrize("where", ["create_staged", "copy_extents"])
def test_a_writer_to_a_full_cache_gets_enospc_when_the_backing_hangs(h, where):
    a_data = pattern(CACHE, seed=3)

    async def test(core):
        fa, a = await create(core, b"a")
        for off in range(0, CACHE, 4 * BS):
            await write(core, fa, a_data[off:off + 4 * BS], off=off)
        assert h.store.used == BLOCKS * BS
        hang = h.backing.inject(where, hang=True)
        fb, b = await create(core, b"b")
        results = {}

        async def writer(name, fh, off):
            t = time.monotonic()
            try:
                await core.handles.write(fh, off, b"w" * BS)
                results[name] = ("written", time.monotonic() - t)
            except FsError as e:
                results[name] = (e.errno, time.monotonic() - t)

        async with trio.open_nursery() as n:
            n.start_soon(writer, "b", fb, 0)
            await trio.to_thread.run_sync(hang.entered.wait, 5)   # a's write-through is held
            n.start_soon(writer, "a", fa, CACHE)   # a writer of the file being written through
            # meanwhile the loop answers: lookups, reads of the cached file
            t = time.monotonic()
            assert (await core.lookup(ROOT, b"a")) is a
            assert await read(core, fa, 10) == a_data[:10]
            assert time.monotonic() - t < 0.1
        assert results["b"][0] == errno.ENOSPC, results
        assert results["a"][0] == errno.ENOSPC, results
        assert TIMEOUT <= results["b"][1] < TIMEOUT + 1.5, results
        assert results["a"][1] < TIMEOUT + 1.5, results
        assert b.size == 0 and a.size == CACHE                # nothing half written
        hang.release()                                          # the backing answers again
        while a.staged is None:
            await trio.sleep(0.01)
        assert a.content is None and h.store.used == 0 * BS
        await write(core, fb, b"b" * BS)                       # room again
        await close(core, fa)
        await close(core, fb)
        await drain(h)
    run(h, test, cache_full_timeout=TIMEOUT)
    assert (h.back / "a").read_bytes() == a_data
    assert (h.back / "b").read_bytes() == b"b" * BS
    assert staged_files(h) == []


def test_truncate_of_a_staged_file(h):
    data = pattern(CACHE + BS, seed=4)

    async def test(core):
        fh, node = await create(core, b"t")
        await write(core, fh, data)
        sp = node.staged
        assert sp is not None
        await core.setattr(node.ino, size=10000)
        assert node.size == 10000 and node.staged is sp
        assert os.fstat(sp.fd).st_size == 10000
        assert await read(core, fh, 2 * CACHE) == data[:10000]
        await core.setattr(node.ino, size=30000)                 # grows with zeros
        assert await read(core, fh, 2 * CACHE) == data[:10000] + bytes(20000)
        await write(core, fh, b"X" * 10, off=12000)
        assert node.size == 30000
        await close(core, fh)
        await drain(h)
    run(h, test)
    assert (h.back / "t").read_bytes() == data[:10000] + bytes(2000) + b"X" * 10 + bytes(17990)


def test_truncate_to_zero_and_regrow_of_a_staged_file(h):
    data = pattern(CACHE + BS, seed=5)

    async def test(core):
        fh, node = await create(core, b"z")
        await write(core, fh, data)
        assert node.staged is not None
        await core.setattr(node.ino, size=0)
        assert await read(core, fh, 100) == b""
        await write(core, fh, b"again", off=0)
        assert await read(core, fh, 100) == b"again"
        await close(core, fh)
        await drain(h)
    run(h, test)
    assert (h.back / "z").read_bytes() == b"again"


def test_a_file_larger_than_half_the_cache_is_staged_when_opened_for_writing(tmp_path, make_core):
    old = pattern(CACHE // 2 + 5 * BS, seed=6)
    back = tmp_path / "s" / "back"
    back.mkdir(parents=True)
    (back / "big").write_bytes(old)
    h = make_core("s", blocks=BLOCKS)

    async def test(core):
        node = await core.lookup(ROOT, b"big")
        fr, _, _ = await core.handles.open(node.ino, os.O_RDONLY)            # a reader of the old version
        with pytest.raises(OSError) as e:   # its kernel inode reads the version it opened
            await core.handles.open(node.ino, os.O_RDWR)
        assert e.value.errno == errno.ESTALE and node.nodeid != node.ino
        fh, _, _ = await core.handles.open(node.nodeid, os.O_RDWR)   # the kernel's second try
        assert node.staged is not None and node.content is None
        assert h.store.used == 0 * BS                            # copied in the backing only
        await write(core, fh, b"NEW", off=BS)
        assert await read(core, fh, 8, off=BS - 2) == old[BS - 2:BS] + b"NEW" + old[BS + 3:BS + 6]
        await close(core, fh)
        await drain(h)
        assert await read(core, fr, 3, off=BS) == old[BS:BS + 3]   # the version it opened
        await core.handles.release(fr)
    run(h, test)
    assert (back / "big").read_bytes() == old[:BS] + b"NEW" + old[BS + 3:]
    assert staged_files(h) == []


def test_fsync_backing_of_a_staged_file_makes_it_durable_in_place(h):
    data = pattern(CACHE + BS, seed=7)

    async def test(core):
        fh, node = await create(core, b"f")
        await write(core, fh, data)
        assert node.staged is not None
        n = len([c for c in h.backing.calls if c[0] == "fsync"])
        await core.handles.fsync(fh)                                    # fsync of the staged file
        assert len([c for c in h.backing.calls if c[0] == "fsync"]) == n + 1
        assert not (h.back / "f").exists()                       # published at close only
        await close(core, fh)
        await drain(h)
    run(h, test, fsync_backing=True)
    assert (h.back / "f").read_bytes() == data


def test_a_written_through_file_deleted_while_open_leaves_nothing(h):
    data = pattern(CACHE + BS, seed=8)

    async def test(core):
        fh, node = await create(core, b"gone")
        await write(core, fh, data)
        assert node.staged is not None
        await core.unlink(ROOT, b"gone")
        assert await read(core, fh, 10) == data[:10]             # still readable while open
        await core.handles.release(fh)
        await drain(h)
        for _ in range(200):                                     # the discard runs in a worker
            if not os.listdir(h.back):
                break
            await trio.sleep(0.01)
    run(h, test)
    assert os.listdir(h.back) == []
