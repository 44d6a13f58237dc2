"""Hard links in the unit tier: the cases a review found, each driven through the real cache
and flusher over a backing another writer also changes (no mount)."""

from __future__ import annotations

import os

from harness import write_file


def listed(cache, d):
    cache.coherence.attach_listing(d, cache.coherence.list_backing(d))
    return d


def test_the_link_count_never_falls_below_the_names_the_mount_has(tmp_path, make_core):
    """a and d/b are one file in the backing (2 links) when the root is listed; another
    program links it as e/c too before d and e are listed. After a and d/b are unlinked,
    e/c is still a live file: written through it, the new version lands there."""
    back = tmp_path / "c" / "back"
    (back / "d").mkdir(parents=True)
    (back / "e").mkdir()
    (back / "a").write_bytes(b"old")
    os.link(back / "a", back / "d" / "b")
    core = make_core("c")
    cache, root = core.cache, core.cache.inodes.root
    node = cache.names.lookup(root, b"a")
    assert node.nlink == 2
    os.link(back / "a", back / "e" / "c")             # behind the mount's back
    d = listed(cache, cache.names.lookup(root, b"d"))
    e = listed(cache, cache.names.lookup(root, b"e"))
    assert cache.names.lookup(d, b"b") is node and cache.names.lookup(e, b"c") is node
    assert node.nlink == 3
    cache.names.unlink(root, b"a")
    cache.names.unlink(d, b"b")
    assert node.nlink == 1 and cache.names.lookup(e, b"c") is node
    cache.files.open(node, True, True)
    cache.files.write(node, 0, b"new")
    cache.files.release(node, True)
    core.drain()
    assert (back / "e" / "c").read_bytes() == b"new"
    assert not (back / "a").exists() and not (back / "d" / "b").exists()


def test_a_linked_file_renamed_over_stays_pending_until_the_rename_lands(core):
    """x (never closed) renamed over a, one of the names of f: f is not quiescent while that
    rename is queued (a listing meanwhile must not touch its positions)."""
    cache, root = core.cache, core.cache.inodes.root
    f = write_file(cache, b"a", b"f")
    cache.files.release(f, True)
    cache.names.link(f, root, b"b")
    core.drain()
    held = core.backing.inject("rename", hang=True)
    try:
        x = write_file(cache, b"x", b"x")            # open: never closed
        cache.names.rename(root, b"x", root, b"a")
        assert not cache.coherence.quiescent(f)
    finally:
        held.release()
    core.drain()
    assert cache.coherence.quiescent(f)
    assert not (core.back / "a").exists() and (core.back / "b").read_bytes() == b"f"
    cache.files.release(x, True)
    core.drain()
    assert (core.back / "a").read_bytes() == b"x"


def test_a_chmod_of_a_linked_file_whose_first_name_another_writer_removed(core):
    """The attributes land under the file's next name; its unlink then removes that one."""
    cache, root = core.cache, core.cache.inodes.root
    f = write_file(cache, b"a", b"f")
    cache.files.release(f, True)
    cache.names.link(f, root, b"b")
    core.drain()
    os.unlink(core.back / "a")                       # another writer
    cache.names.setattr(f, mode=0o600)
    core.drain()
    assert oct(os.stat(core.back / "b").st_mode & 0o777) == oct(0o600)
    cache.names.unlink(root, b"a")
    cache.names.unlink(root, b"b")
    core.drain()
    assert not (core.back / "b").exists()
    assert core.flusher.repairs.conflicts.status()["by_kind"]["gone"] == 1


def test_a_link_made_after_close_acknowledged_content_is_in_its_journal_record(make_core):
    """close() answered (a "flushed" record), then ln, then the daemon dies before RELEASE:
    the file's last record names both names, so the replay lands the content under both."""
    from acpfs.oplog import journal as jmod
    core = make_core("j", journal=True)
    cache, root = core.cache, core.cache.inodes.root
    d = cache.names.mkdir(root, b"d", 0o755, 0, 0)
    f = write_file(cache, b"a", b"content")
    cache.files.record_close(f)                            # FLUSH answered, no RELEASE yet
    cache.names.link(f, d, b"b")
    left = jmod.read_leftover(str(core.cache_dir))
    last = [r for r in left.records if r.ino == f.ino and r.seq == 0][-1]
    assert (last.kind, last.path, last.links) == (jmod.FLUSHED, b"a", [b"d/b"])
    cache.files.release(f, True)


def test_a_new_version_lands_under_the_names_the_mount_does_not_know(tmp_path, make_core):
    """a and d/b are one file in the backing; d is never listed: a new version of a lands
    under d/b too (found by inode in the backing), as one file, and no conflict is counted.
    A name outside the backing directory would keep the version before (a split)."""
    back = tmp_path / "s" / "back"
    (back / "d").mkdir(parents=True)
    (back / "a").write_bytes(b"old")
    os.link(back / "a", back / "d" / "b")
    core = make_core("s")
    cache, root = core.cache, core.cache.inodes.root
    node = cache.names.lookup(root, b"a")
    cache.files.open(node, True, True)
    cache.files.write(node, 0, b"new")
    cache.files.release(node, True)
    core.drain()
    assert (back / "a").read_bytes() == b"new" and (back / "d" / "b").read_bytes() == b"new"
    assert os.stat(back / "a").st_ino == os.stat(back / "d" / "b").st_ino
    assert core.flusher.repairs.conflicts.status()["total"] == 0
