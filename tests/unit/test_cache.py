"""The cache and flusher without a mount: block pool, copy-on-write snapshots, eviction, order."""

from __future__ import annotations

import os
import threading
import time

import pytest

from acpfs.flusher.flusher import Flusher
from acpfs.store.api import CacheFull

from harness import BS, write_file


def drain(flusher: Flusher, seq: int) -> None:
    deadline = time.time() + 30
    while flusher.oplog.applied_seq < seq:
        assert time.time() < deadline, "flusher did not drain"
        time.sleep(0.005)


@pytest.fixture
def core(core):
    return core.cache, core.flusher, core.back


def test_snapshot_is_immune_to_later_writes(core):
    cache, flusher, back = core
    node = write_file(cache, b"f", b"A" * (3 * BS))
    with cache.inodes.position_lock:        # hold the flusher so the snapshot stays queued
        cache.files.release(node, True)
        cache.files.open(node, True, False)
        cache.files.write(node, BS, b"B" * BS)   # must copy the shared block, not change the snapshot
    cache.files.release(node, True)
    drain(flusher, cache.oplog.seq)
    assert (back / "f").read_bytes() == b"A" * BS + b"B" * BS + b"A" * BS
    assert cache.store.used == 3 * BS     # the copies of the snapshot were freed


def test_truncate_zeroes_the_tail_so_growth_shows_zeros(core):
    cache, flusher, back = core
    node = write_file(cache, b"t", b"x" * 5000)
    cache.files.truncate(node, 10)
    cache.files.truncate(node, 6000)
    assert bytes(cache.files.read(node, 0, 6000)) == b"x" * 10 + bytes(5990)


def test_full_pool_evicts_persisted_files_first(core):
    cache, flusher, back = core
    a = write_file(cache, b"a", b"a" * (40 * BS))
    cache.files.release(a, True)
    drain(flusher, cache.oplog.seq)
    b = write_file(cache, b"b", b"b" * (40 * BS))    # needs a's blocks: a is evicted
    assert a.content is None and cache.files.read(a, 0, 1) is None   # now read from the backing
    with pytest.raises(CacheFull):
        cache.files.write(b, 40 * BS, b"c" * (30 * BS))    # nothing evictable left: the caller waits
    assert b.size == 40 * BS                          # and nothing was written
    cache.files.release(b, True)
    drain(flusher, cache.oplog.seq)
    assert (back / "b").read_bytes() == b"b" * (40 * BS)


def test_file_read_while_the_cache_was_full_is_evictable_after(core):
    """A persisted file the kernel reads (passthrough) cannot be evicted while it is open;
    once closed it must be evictable again, or its space is lost to the cache for good."""
    cache, flusher, back = core
    a = write_file(cache, b"a", b"a" * (40 * BS))
    cache.files.release(a, True)
    drain(flusher, cache.oplog.seq)
    cache.files.open(a, False, False, passthrough=True)        # a reader the kernel serves
    b = write_file(cache, b"b", b"")
    with pytest.raises(CacheFull):
        cache.files.write(b, 0, b"b" * (40 * BS))            # a is pinned: nothing to evict
    cache.files.release(a, False, passthrough=True)
    assert cache.files.write(b, 0, b"b" * (40 * BS)) == 40 * BS   # a is evicted now
    assert a.content is None
    cache.files.release(b, True)
    drain(flusher, cache.oplog.seq)
    assert (back / "b").read_bytes() == b"b" * (40 * BS)


def test_unlinked_before_persisted_is_never_uploaded(core):
    cache, flusher, back = core
    with cache.inodes.position_lock:        # hold the flusher back
        node = write_file(cache, b"gone", b"g" * BS)
        cache.files.release(node, True)
        cache.names.unlink(cache.inodes.root, b"gone")
    drain(flusher, cache.oplog.seq)
    assert not (back / "gone").exists()
    assert not [n for n in os.listdir(back) if n.startswith(".acpfs-tmp-")]
    assert cache.store.used == 0 * BS


def test_rename_of_a_never_closed_file_leaves_the_name_empty_until_its_close(core):
    """The mount's history of closed files has no file at ``latest`` between the rename of a
    file never closed over it and that file's close: the backing shows the same (the old
    bytes under the name would be a state the mount never had)."""
    cache, flusher, back = core
    old = write_file(cache, b"latest", b"old")
    cache.files.release(old, True)
    drain(flusher, cache.oplog.seq)
    new = write_file(cache, b"latest.tmp", b"new")   # still open: not in the backing
    cache.names.rename(cache.inodes.root, b"latest.tmp", cache.inodes.root, b"latest")
    drain(flusher, cache.oplog.seq)
    assert sorted(os.listdir(back)) == []
    cache.files.release(new, True)
    drain(flusher, cache.oplog.seq)
    assert sorted(os.listdir(back)) == ["latest"] and (back / "latest").read_bytes() == b"new"


def test_unlinked_after_later_changes_is_published_then_removed(make_core):
    """A file deleted after other changes followed its close is uploaded and removed in order:
    skipping it would show those changes without it (a pointer ahead of its checkpoint)."""
    c = make_core()
    cache, flusher, back = c.cache, c.flusher, c.back
    held = c.backing.inject("unlink", hang=True)
    try:
        with cache.inodes.position_lock:        # every op is queued before the first is applied
            cache.files.release(write_file(cache, b"model", b"m" * BS), True)
            cache.files.release(write_file(cache, b"latest", b"s1"), True)
            cache.names.unlink(cache.inodes.root, b"model")
        assert held.entered.wait(20)
        assert sorted(os.listdir(back)) == ["latest", "model"]
        assert (back / "model").read_bytes() == b"m" * BS
    finally:
        held.release()
    drain(flusher, cache.oplog.seq)
    assert sorted(os.listdir(back)) == ["latest"]


def test_applied_seq_moves_only_after_the_op_is_finished(core):
    """WriteThrough.wait_seq reads applied_seq without the lock and then relies on the op's bookkeeping
    (a published staged file detached from its node, block references dropped): whoever sees an op
    applied must see it finished. (Set before _finish, a writer opening a file in that window
    kept a staged file that _finish then took away, and its next write failed with EIO.)"""
    cache, flusher, back = core
    seen: list[tuple[int, int]] = []
    finish = flusher._finish

    def watched(op):
        seen.append((op.seq, flusher.oplog.applied_seq))
        finish(op)
    flusher._finish = watched
    for i in range(5):
        cache.files.release(write_file(cache, b"f%d" % i, b"x" * BS), True)
    cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    drain(flusher, cache.oplog.seq)
    assert len(seen) == 6
    assert all(applied < seq for seq, applied in seen), seen
    assert flusher.oplog.applied_seq == cache.oplog.seq


def test_merging_the_backing_listing_shows_others_changes_and_keeps_own_pending_ones(make_core):
    """Close-to-open coherence (Coherence.merge_listing): entries another writer made appear,
    entries it removed disappear, and this mount's own pending changes win."""
    c = make_core("m")
    cache, back = c.cache, c.back
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    for name in (b"mine", b"clean", b"dirty"):
        cache.files.release(write_file(cache, name, name, parent=d), True)
    c.drain()
    (back / "d" / "theirs").write_bytes(b"t")       # another node's new file
    os.unlink(back / "d" / "clean")                  # another node removed a clean file
    os.unlink(back / "d" / "dirty")                  # ... and one this mount changes now
    dirty = cache.names.lookup(d, b"dirty")
    cache.files.open(dirty, True, False)
    cache.files.write(dirty, 0, b"changed")
    with cache.inodes.position_lock:                        # the flusher applies nothing meanwhile
        cache.names.unlink(d, b"mine")                     # this mount's removal, still queued
        relisting = _relist(cache, d)
    cache.coherence.merge_listing(d, *relisting)
    assert sorted(d.children) == [b"dirty", b"theirs"]
    assert cache.files.read(d.children[b"dirty"], 0, 100) == b"changed"
    c.drain()
    cache.files.release(dirty, True)
    c.drain()
    assert sorted(os.listdir(back / "d")) == ["dirty", "theirs"]


def _relist(cache, d):
    """Coherence.relist_backing, with position_lock already held by the test."""
    lock, cache.inodes.position_lock = cache.inodes.position_lock, threading.Lock()
    try:
        return cache.coherence.relist_backing(d)
    finally:
        cache.inodes.position_lock = lock


def test_directory_link_counts_follow_random_namespace_changes(core):
    """A directory's link count (2 + its subdirectories, kept by ``Children.dirs`` rather
    than counted at each GETATTR) equals a count of its entries after every change, over
    random mkdir, create, rename (over files and empty directories), unlink and rmdir."""
    import random
    from acpfs.fuse.operations import dir_links
    cache, flusher, back = core
    rng = random.Random(7)
    dirs = [cache.inodes.root]
    for _ in range(600):
        d = rng.choice(dirs)
        if d.parent is None and d is not cache.inodes.root:
            dirs.remove(d)
            continue
        name = b"n%d" % rng.randrange(12)
        op = rng.choice(("mkdir", "create", "rename", "remove"))
        try:
            if op == "mkdir":
                dirs.append(cache.names.mkdir(d, name, 0o755, 0, 0))
            elif op == "create":
                cache.names.create(d, name, 0o644, 0, 0)
            elif op == "rename":
                node, to = cache.names.lookup(d, name), rng.choice(dirs)
                up = to
                while up is not None and up is not node:   # the kernel refuses a directory
                    up = up.parent                         # into itself (EINVAL)
                if up is None:
                    cache.names.rename(d, name, to, b"n%d" % rng.randrange(12))
            else:
                node = cache.names.lookup(d, name)
                (cache.names.rmdir if node.is_dir else cache.names.unlink)(d, name)
        except OSError:
            pass    # EEXIST, ENOENT, ENOTEMPTY, EISDIR, ENOTDIR, EINVAL: nothing changed
        for x in dirs:
            if x.children is not None and (x.parent is not None or x is cache.inodes.root):
                assert dir_links(x) == 2 + sum(c.is_dir for c in x.children.values())
    assert any(dir_links(x) > 2 for x in dirs)


def test_a_name_is_known_exactly_when_the_directory_walk_says_so(make_core):
    """``Coherence._name_known`` (one name, without walking the directory) agrees with
    ``_known_names`` (every name of the directory) at random points of random renames,
    links, removals and creates, while the flusher is held part of the time, so that ops
    are queued, in flight and applied. The cache holds every version the held uploads keep
    (4 MiB: the test is of names, not of a full cache)."""
    import random
    parts = make_core(blocks=1024)
    cache, flusher = parts.cache, parts.flusher
    rng = random.Random(11)
    backing = cache.backing
    held = None
    d1 = cache.names.mkdir(cache.inodes.root, b"d1", 0o755, 0, 0)
    d2 = cache.names.mkdir(cache.inodes.root, b"d2", 0o755, 0, 0)
    dirs = [cache.inodes.root, d1, d2]
    names = [b"n%d" % i for i in range(6)]
    most = 0
    try:
        for step in range(400):
            if step % 50 == 0:
                if held is None:
                    held = backing.inject("write_temp", hang=True)   # uploads wait: ops queue
                else:
                    held.release()
                    backing.clear()
                    held = None
            d, name = rng.choice(dirs), rng.choice(names)
            try:
                op = rng.choice(("create", "rename", "link", "unlink"))
                if op == "create":     # written and closed: its upload is held
                    node = write_file(cache, name, b"x" * rng.randrange(1, 5000), parent=d)
                    cache.files.release(node, True)
                elif op == "rename":
                    cache.names.rename(d, name, rng.choice(dirs), rng.choice(names))
                elif op == "link":
                    cache.names.link(cache.names.lookup(d, name), rng.choice(dirs), rng.choice(names))
                elif not cache.names.lookup(d, name).is_dir:
                    cache.names.unlink(d, name)
            except OSError:
                pass
            most = max(most, len(flusher.oplog.queue))
            with cache.inodes.position_lock:
                for x in dirs:
                    known = cache.coherence._known_names(x)[0]
                    for n in names:
                        assert cache.coherence._name_known(x, n) == (n in known), (x.name, n)
        assert most >= 20, most    # ops were queued behind held uploads
    finally:
        if held is not None:
            held.release()
            backing.clear()
