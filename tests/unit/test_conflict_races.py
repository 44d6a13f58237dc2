"""Races and corner cases of the conflict rules and of coherence, found in review (contract 10):
each test was a failing reproduction of the code before its fix."""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import pytest
import trio

import triocore as tc
from test_conflicts import other_writes, save


def _relist_merge(cache, d):
    cache.coherence.merge_listing(d, *cache.coherence.relist_backing(d))


def _drain_or_stuck(core, timeout=3.0):
    deadline = time.monotonic() + timeout
    while core.flusher.oplog.applied_seq < core.cache.oplog.seq:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# A: unlink of a symlink removes another writer's regular file (no type check for links)
def test_A_unlink_of_symlink_keeps_another_writers_file(core):
    cache, back = core.cache, core.back
    cache.names.symlink(cache.inodes.root, b"latest", b"step_1", 0, 0)
    core.drain()
    os.unlink(back / "latest")
    (back / "latest").write_bytes(b"another node's file")      # another kind of entry
    cache.names.unlink(cache.inodes.root, b"latest")
    core.drain()
    print(core.flusher.repairs.conflicts.status())
    assert (back / "latest").exists(), "another node's regular file was removed"


def test_A2_unlink_of_symlink_keeps_another_writers_newer_symlink(core):
    cache, back = core.cache, core.back
    cache.names.symlink(cache.inodes.root, b"latest", b"step_1", 0, 0)
    core.drain()
    os.unlink(back / "latest")
    os.symlink("step_9", back / "latest")
    cache.names.unlink(cache.inodes.root, b"latest")
    core.drain()
    assert os.path.islink(back / "latest"), "another node's newer symlink was removed"


# B: a setattr with times adopts another writer's version as this node's own
def test_B_setattr_times_adopts_another_writers_version(core):
    cache, back = core.cache, core.back
    save(cache, b"f", b"v1")
    core.drain()
    other_writes(back / "f", b"v2 from another node, longer")
    node = cache.names.lookup(cache.inodes.root, b"f")
    cache.names.setattr(node, atime=10**18, mtime=10**18)        # touch -d / os.utime
    core.drain()
    st = os.stat(back / "f")
    print("node.backing_version", node.backing_version, "backing", (st.st_ino, st.st_size, st.st_mtime_ns))
    # the listing of its directory no longer sees anything new: the view stays v1 (size 2)
    _relist_merge(cache, cache.inodes.root)
    print("node.size after listing", node.size, "backing size", st.st_size)
    assert node.size == st.st_size, "this node's view keeps the stale size for good"


def test_B2_then_unlink_removes_the_other_writers_version(core):
    cache, back = core.cache, core.back
    save(cache, b"f", b"v1")
    core.drain()
    other_writes(back / "f", b"v2 from another node, longer")
    node = cache.names.lookup(cache.inodes.root, b"f")
    cache.names.setattr(node, atime=10**18, mtime=10**18)
    cache.names.unlink(cache.inodes.root, b"f")
    core.drain()
    print(core.flusher.repairs.conflicts.status()["by_kind"])
    assert (back / "f").exists(), "v2 (another node's) removed, no 'kept'"


# E: .acpfs-conflicts not usable (a file there; or another uid's 0700 dir) wedges the flusher
def test_E_a_file_named_like_the_conflicts_folder_wedges_nothing(core):
    cache, back = core.cache, core.back
    (back / ".acpfs-conflicts").write_bytes(b"someone's file")
    (back / "x").mkdir()
    save(cache, b"x", b"mine")
    ok = _drain_or_stuck(core)
    op = core.flusher.failing_op()
    print("failing:", op and (op.path, op.error, op.attempts))
    core.backing.clear()
    os.unlink(back / ".acpfs-conflicts")      # let the harness drain at teardown
    assert ok, "publish retried for ever"


# F: a directory removed elsewhere (merge_listing) still accepts creates (cwd / dir fd in it):
# the op has no backing path, and the sequencer retries it for ever
def test_F_no_entry_is_made_in_a_directory_removed_elsewhere(core):
    cache, back = core.cache, core.back
    d = cache.names.mkdir(cache.inodes.root, b"step_1", 0o755, 0, 0)
    sub = cache.names.mkdir(d, b"sub", 0o755, 0, 0)
    save(cache, b"a", b"a", parent=sub)
    core.drain()
    d.lookups = sub.lookups = 1          # the kernel holds them (a cwd, an open dir fd)
    shutil.rmtree(back / "step_1")         # another node's rotation
    _relist_merge(cache, cache.inodes.root)
    assert b"step_1" not in cache.inodes.root.children
    with pytest.raises(OSError) as e:                          # openat(dirfd, O_CREAT) in it
        save(cache, b"late", b"acknowledged", parent=sub)
    assert e.value.errno == errno.ENOENT                       # as in a directory removed here
    with pytest.raises(OSError):
        cache.names.mkdir(sub, b"x", 0o755, 0, 0)
    core.drain()
    assert core.flusher.failing_op() is None


# C: Loader.revalidated applies a stat taken before this node's own publish landed
def test_C_revalidate_applies_a_stat_older_than_its_own_publish(core):
    cache, back = core.cache, core.back
    go = threading.Event()
    statted = threading.Event()
    real = cache.coherence.stat_backing

    def slow_to_resume(node):
        st = real(node)          # the old version, under position_lock
        statted.set()
        go.wait(0.4)             # the trio thread busy elsewhere, or GIL: resumption late
        return st
    cache.coherence.stat_backing = slow_to_resume

    async def test(c):
        fh, node = await tc.create(c, b"f")
        await tc.write(c, fh, b"v1")
        await tc.close(c, fh)
        await tc.drain(core)
        node.checked_at = 0.0

        async def writer():
            await trio.to_thread.run_sync(statted.wait)
            fh2, _ = await c.handles.open(node.ino, os.O_WRONLY | os.O_TRUNC), None
            fh2 = fh2[0]
            await tc.write(c, fh2, b"v2 from this node, longer")
            await tc.close(c, fh2)
            await tc.drain(core)
            go.set()
        async with trio.open_nursery() as n:
            n.start_soon(writer)
            await c.getattr(node.ino)          # a stat or lookup of the file
        print("size in view", node.size, "backing", os.stat(back / "f").st_size)
        size_ok = node.size == os.stat(back / "f").st_size
        cache.names.unlink(cache.inodes.root, b"f")
        await tc.drain(core)
        print(core.flusher.repairs.conflicts.status()["by_kind"])
        print("backing still has f:", (back / "f").exists())
        assert size_ok and not (back / "f").exists()
    tc.run(core, test, coherence_timeout=0.0)


# D: a reader of an uncached file switches to another node's version in the middle of a read
def test_D_open_reader_switches_versions_mid_read(core):
    cache, back = core.cache, core.back
    BS = 4096
    v1, v2 = b"1" * (2 * BS), b"2" * (2 * BS)

    async def test(c):
        d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
        fh, node = await tc.create(c, b"f", parent=d.ino)
        await tc.write(c, fh, v1)
        await tc.close(c, fh)
        await tc.drain(core)
        with cache.oplog.lock:                       # evicted: read from the backing
            cache.store.drop(node.content)
            node.content = None
            cache.files.lru.pop(node.ino, None)
        rfh, _, _ = await c.handles.open(node.ino, os.O_RDONLY)
        first = await tc.read(c, rfh, BS, 0)
        other_writes(back / "d" / "f", v2)
        d.listed_at = 0.0
        await c.handles.opendir(d.ino)                 # anyone's ls of the directory
        second = await tc.read(c, rfh, BS, BS)
        await c.handles.release(rfh)
        print(first[:4], second[:4])
        assert first[:1] == second[:1], "one open read a mix of two versions"
    tc.run(core, test, coherence_timeout=0.0)
