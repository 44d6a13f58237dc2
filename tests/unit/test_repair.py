"""Failures that retrying alone cannot cure are repaired, not retried for ever (changes made to
the backing behind acpfs's back): a temporary file removed from the backing before its publish
is written again (also a staged file, from the descriptor the op still holds); a directory
removed or moved away behind acpfs's back is made again from the mount's view, so that what the
mount acknowledged lands where the mount has it."""

from __future__ import annotations

import os
import shutil
import stat
import time

import pytest

from harness import BS, write_file
from triocore import close, create, drain, pattern, run, write

WAIT = 10


def temps(d) -> list[str]:
    return [n for n in os.listdir(d) if n.startswith(".acpfs-tmp-")]


def test_a_temporary_file_removed_before_its_publish_is_written_again(core):
    cache, back = core.cache, core.back
    held = core.backing.inject("publish", hang=True, times=1)
    node = write_file(cache, b"latest", b"step_2")
    cache.files.release(node, True)
    assert held.entered.wait(WAIT)
    [tmp] = temps(back)                  # uploaded, about to be renamed into place
    os.unlink(back / tmp)                # removed behind acpfs's back
    held.release()
    core.drain()
    assert (back / "latest").read_bytes() == b"step_2"
    assert temps(back) == []
    assert core.flusher.failing_op() is None


def test_a_directory_moved_away_is_made_again_and_the_file_lands_in_it(core):
    cache, back = core.cache, core.back
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o750, 0, 0)
    cache.files.release(write_file(cache, b"old", b"persisted", parent=d), True)
    core.drain()
    held = core.backing.inject("write_temp", hang=True, times=1)   # the first: z
    cache.files.release(write_file(cache, b"z", b"z"), True)   # holds the sequencer; uploads go on
    assert held.entered.wait(WAIT)
    cache.files.release(write_file(cache, b"f", b"acknowledged", parent=d), True)
    deadline = time.monotonic() + WAIT
    while not temps(back / "d"):                     # d/f is uploaded, waiting for its turn
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.rename(back / "d", back / "d.away")           # the temporary file goes with it
    held.release()
    core.drain()
    assert (back / "d" / "f").read_bytes() == b"acknowledged"
    assert stat.S_IMODE(os.stat(back / "d").st_mode) == 0o750     # the mount's mode
    assert sorted(os.listdir(back / "d.away")) == ["old"]          # nothing landed there
    assert core.flusher.failing_op() is None


@pytest.mark.parametrize("gone", ["dir", "parents"])
def test_ops_into_a_removed_directory_make_it_again(core, gone):
    cache, back = core.cache, core.back
    a = cache.names.mkdir(cache.inodes.root, b"a", 0o755, 0, 0)
    b = cache.names.mkdir(a, b"b", 0o700, 0, 0)
    core.drain()
    shutil.rmtree(back / "a" / "b" if gone == "dir" else back / "a")
    cache.names.mkdir(b, b"c", 0o755, 0, 0)
    cache.names.symlink(b, b"l", b"c", 0, 0)
    cache.files.release(write_file(cache, b"f", b"F" * (BS + 1), parent=b), True)
    core.drain()
    assert sorted(os.listdir(back / "a" / "b")) == ["c", "f", "l"]
    assert stat.S_IMODE(os.stat(back / "a" / "b").st_mode) == 0o700
    assert (back / "a" / "b" / "f").read_bytes() == b"F" * (BS + 1)


def test_a_rename_whose_source_was_removed_goes_on(core):
    cache, back = core.cache, core.back
    cache.files.release(write_file(cache, b"a", b"A"), True)
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    core.drain()
    os.unlink(back / "a")
    os.rmdir(back / "d")
    cache.names.rename(cache.inodes.root, b"a", cache.inodes.root, b"b")
    cache.names.rename(cache.inodes.root, b"d", cache.inodes.root, b"e")
    cache.files.release(write_file(cache, b"x", b"X", parent=d), True)
    core.drain()
    assert sorted(os.listdir(back)) == ["e"]          # a's bytes are gone (not ours to invent)
    assert (back / "e" / "x").read_bytes() == b"X"      # the directory is the mount's again
    assert core.flusher.failing_op() is None


def test_a_staged_file_removed_before_its_publish_is_copied_back(make_core):
    h = make_core(blocks=16)
    data = pattern(20 * BS + 5)                          # more than the cache: staged

    async def test(c):
        fh, node = await create(c, b"big")
        await write(c, fh, data)
        assert node.staged is not None
        held = h.backing.inject("publish", hang=True, times=1)
        await close(c, fh)
        while not held.entered.is_set():
            await trio_sleep()
        staging = h.back / os.fsdecode(h.backing.staging_dir)
        [name] = os.listdir(staging)
        os.unlink(staging / name)                        # removed behind acpfs's back
        held.release()
        await drain(h)
    run(h, test)
    assert (h.back / "big").read_bytes() == data
    assert temps(h.back) == []
    assert h.flusher.failing_op() is None


async def trio_sleep() -> None:
    import trio
    await trio.sleep(0.01)


def test_an_upload_cut_short_by_an_abort_is_not_recorded_as_applied(make_core):
    """A second signal aborts the drain. An upload it cuts short is not 'void': recording it
    as applied would lose its content at the next start (found in review)."""
    c = make_core("ab", journal=True)
    held = c.backing.inject("copy_extents", hang=True, times=1)
    node = write_file(c.cache, b"f", b"x" * (3 * BS))
    c.cache.files.release(node, True)
    assert held.entered.wait(WAIT)
    c.flusher.abort.set()                        # what stop(drain=False) does
    held.release()
    c.flusher.stop(drain=False, timeout=10)
    applied = int.from_bytes((c.cache_dir / "applied").read_bytes()[:8] or b"\0", "little")
    assert applied < node.last_seq, "the cut-short upload was recorded as applied"
    assert not (c.back / "f").exists()


def test_a_chmod_in_a_removed_directory_makes_it_again(core):
    cache, back = core.cache, core.back
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o750, 0, 0)
    f = write_file(cache, b"f", b"F", parent=d)
    cache.files.release(f, True)
    core.drain()
    shutil.rmtree(back / "d")
    cache.names.setattr(f, mode=0o600)                 # its file is gone with the directory
    cache.names.setattr(d, mode=0o700)
    core.drain()
    assert stat.S_IMODE(os.stat(back / "d").st_mode) == 0o700
    assert core.flusher.failing_op() is None


def test_a_directory_renamed_after_its_parent_was_removed_is_made_again(core):
    cache, back = core.cache, core.back
    p = cache.names.mkdir(cache.inodes.root, b"p", 0o755, 0, 0)
    x = cache.names.mkdir(p, b"x", 0o755, 0, 0)
    core.drain()
    shutil.rmtree(back / "p")
    cache.names.rename(p, b"x", p, b"y")
    cache.files.release(write_file(cache, b"f", b"into y", parent=x), True)
    core.drain()
    assert (back / "p" / "y" / "f").read_bytes() == b"into y"
    assert core.flusher.failing_op() is None
