"""Conflicts with other writers of the shared backing (contract 10; acpfs/conflicts.py): for every
op, what the flusher does when another node or program changed the backing meanwhile. Each
case is resolved by its documented rule, counted, and the queue moves on: a later change of
this node lands after it, and nothing acknowledged (by this node or the other writer) is lost.

The other writer here is a plain program writing the backing directory; tests/test_multinode.py
has the same cases between real nodes."""

from __future__ import annotations

import os
import shutil

from harness import write_file


def other_writes(path, data: bytes) -> None:
    """Another writer publishes ``path`` atomically (a new inode, as acpfs and most tools do)."""
    tmp = path.with_name(path.name + ".other-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save(cache, name: bytes, data: bytes, parent=None) -> None:
    cache.files.release(write_file(cache, name, data, parent=parent), True)


def settled(core, **expected: int) -> None:
    """The queue drained, no op failing, a later change still lands, and exactly the
    conflicts ``expected`` (kind: count) were counted."""
    cache = core.cache
    if b"latest" in cache.inodes.root.children:
        cache.names.unlink(cache.inodes.root, b"latest")
    save(cache, b"latest", b"after")
    core.drain()
    assert core.flusher.failing_op() is None
    assert (core.back / "latest").read_bytes() == b"after"
    st = core.flusher.repairs.conflicts.status()
    assert {k: n for k, n in st["by_kind"].items() if n} == expected
    assert st["total"] == sum(expected.values()) == len(st["recent"])


def aside(core) -> list[str]:
    """What was moved to .acpfs-conflicts/, as paths below its per-daemon folder."""
    top = core.back / ".acpfs-conflicts"
    if not top.exists():
        return []
    [stamp] = os.listdir(top)
    assert stamp.endswith(core.backing.instance)
    return sorted(str(p.relative_to(top / stamp)) for p in (top / stamp).rglob("*"))


def test_rmdir_of_a_directory_holding_files_it_never_had_leaves_them_there(core):
    cache, back = core.cache, core.back
    d = cache.names.mkdir(cache.inodes.root, b"step_1", 0o755, 0, 0)
    save(cache, b"rank0", b"mine", parent=d)
    core.drain()
    (back / "step_1" / "rank1").write_bytes(b"another node's shard")   # after this node listed it
    cache.names.unlink(d, b"rank0")
    cache.names.rmdir(cache.inodes.root, b"step_1")
    settled(core, not_empty=1)
    assert os.listdir(back / "step_1") == ["rank1"]
    assert (back / "step_1" / "rank1").read_bytes() == b"another node's shard"
    [c] = core.flusher.repairs.conflicts.status()["recent"]
    assert c["path"] == "step_1" and "'rank1'" in c["theirs"]


def test_unlink_leaves_a_version_it_never_saw_in_place(core):
    cache, back = core.cache, core.back
    save(cache, b"f", b"v1 from this node")
    core.drain()
    other_writes(back / "f", b"v2 from another node")
    cache.names.unlink(cache.inodes.root, b"f")
    settled(core, kept=1)
    assert (back / "f").read_bytes() == b"v2 from another node"


def test_unlink_and_setattr_of_names_already_gone_move_on(core):
    cache, back = core.cache, core.back
    save(cache, b"f", b"x")
    save(cache, b"g", b"y")
    core.drain()
    os.unlink(back / "f")
    os.unlink(back / "g")
    cache.names.unlink(cache.inodes.root, b"f")
    cache.names.setattr(cache.names.lookup(cache.inodes.root, b"g"), mode=0o600)
    settled(core, gone=2)
    assert not (back / "g").exists()      # its next snapshot lands it again


def test_the_last_publisher_of_a_name_wins(core):
    cache, back = core.cache, core.back
    save(cache, b"f", b"v1 from this node")
    core.drain()
    other_writes(back / "f", b"v2 from another node")
    node = cache.names.lookup(cache.inodes.root, b"f")
    cache.files.open(node, True, True)
    cache.files.write(node, 0, b"v3 from this node")
    cache.files.release(node, True)
    settled(core, replaced=1)
    assert (back / "f").read_bytes() == b"v3 from this node"
    # this node's own versions replace each other without a conflict
    cache.files.open(node, True, True)
    cache.files.write(node, 0, b"v4")
    cache.files.release(node, True)
    settled(core, replaced=1)
    assert (back / "f").read_bytes() == b"v4"


def test_a_rename_over_a_name_another_writer_replaced_wins_too(core):
    cache, back = core.cache, core.back
    save(cache, b"ptr", b"step_1")
    core.drain()
    other_writes(back / "ptr", b"step_7 (another node)")
    save(cache, b"ptr.tmp", b"step_2")
    cache.names.rename(cache.inodes.root, b"ptr.tmp", cache.inodes.root, b"ptr")
    settled(core, replaced=1)
    assert (back / "ptr").read_bytes() == b"step_2"


def test_a_file_published_where_another_writer_made_a_directory_moves_it_aside(core):
    cache, back = core.cache, core.back
    (back / "x").mkdir()
    (back / "x" / "inner").write_bytes(b"theirs")
    save(cache, b"x", b"mine")
    settled(core, moved_aside=1)
    assert (back / "x").read_bytes() == b"mine"
    assert aside(core) == ["x", "x/inner"]


def test_a_directory_made_where_another_writer_put_a_file_moves_it_aside(core):
    cache, back = core.cache, core.back
    (back / "d").write_bytes(b"theirs")
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    save(cache, b"f", b"mine", parent=d)
    settled(core, moved_aside=1)
    assert (back / "d" / "f").read_bytes() == b"mine"
    assert aside(core) == ["d"]


def test_ranks_making_the_same_directory_is_no_conflict(core):
    cache, back = core.cache, core.back
    (back / "step_2").mkdir()
    (back / "step_2" / "rank1").write_bytes(b"theirs")
    d = cache.names.mkdir(cache.inodes.root, b"step_2", 0o755, 0, 0)
    save(cache, b"rank0", b"mine", parent=d)
    settled(core)
    assert sorted(os.listdir(back / "step_2")) == ["rank0", "rank1"]


def test_a_directory_removed_by_another_writer_is_made_again_for_what_lands_in_it(core):
    cache, back = core.cache, core.back
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o750, 0, 0)
    save(cache, b"a", b"a", parent=d)
    core.drain()
    shutil.rmtree(back / "d")
    save(cache, b"b", b"acknowledged", parent=d)
    settled(core, dir_recreated=1)
    assert os.listdir(back / "d") == ["b"]


def test_a_directory_replaced_by_a_file_is_made_again_and_the_file_kept_aside(core):
    cache, back = core.cache, core.back
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o750, 0, 0)
    core.drain()
    os.rmdir(back / "d")
    (back / "d").write_bytes(b"theirs")
    save(cache, b"f", b"acknowledged", parent=d)
    settled(core, dir_recreated=1, moved_aside=1)
    assert (back / "d" / "f").read_bytes() == b"acknowledged"
    assert aside(core) == ["d"]


def test_a_directory_renamed_over_a_directory_another_writer_filled_moves_it_aside(core):
    cache, back = core.cache, core.back
    src = cache.names.mkdir(cache.inodes.root, b"tmpdir", 0o755, 0, 0)
    save(cache, b"f", b"mine", parent=src)
    core.drain()
    (back / "final").mkdir()
    (back / "final" / "g").write_bytes(b"theirs")
    (back / "empty").mkdir()
    cache.names.rename(cache.inodes.root, b"tmpdir", cache.inodes.root, b"final")
    other = cache.names.mkdir(cache.inodes.root, b"other", 0o755, 0, 0)
    cache.names.rename(cache.inodes.root, b"other", cache.inodes.root, b"empty")   # empty: replaced, as rename(2) does
    settled(core, moved_aside=1)
    assert os.listdir(back / "final") == ["f"]
    assert aside(core) == ["final", "final/g"]
    assert os.listdir(back / "empty") == []
    assert other.backing_name == b"empty"


def test_a_symlink_made_where_another_writer_put_a_file_replaces_it(core):
    cache, back = core.cache, core.back
    (back / "ln").write_bytes(b"theirs")
    (back / "same").symlink_to("target")
    cache.names.symlink(cache.inodes.root, b"ln", b"target", 0, 0)
    cache.names.symlink(cache.inodes.root, b"same", b"target", 0, 0)    # the same symlink: no conflict
    settled(core, replaced=1)
    assert os.readlink(back / "ln") == "target"
    assert os.readlink(back / "same") == "target"


def test_a_file_renamed_after_another_writer_removed_it_leaves_the_view(core):
    """The rename finds its source gone ("gone"): nothing will publish the file under its new
    name, so the next listing of its directory drops it from this mount's view, which then
    equals the backing (a node once kept such a name for good: seeds 2 and 635963647 of
    test_multinode_model's converge test)."""
    cache, back = core.cache, core.back
    save(cache, b"x", b"content")
    core.drain()
    os.unlink(back / "x")                               # another node removed it
    cache.names.rename(cache.inodes.root, b"x", cache.inodes.root, b"y")
    core.drain()
    assert not (back / "y").exists()
    cache.coherence.merge_listing(cache.inodes.root, *cache.coherence.relist_backing(cache.inodes.root))
    assert b"y" not in cache.inodes.root.children and b"x" not in cache.inodes.root.children
    assert core.flusher.repairs.conflicts.status()["by_kind"]["gone"] == 1


def test_a_special_file_the_backing_refuses_stays_in_the_mount_and_the_queue_moves_on(core):
    """A device node on an NFS export with root_squash: EPERM, which no retry mends. It is
    a conflict ("refused"), kept in the mount only; what comes after lands."""
    import errno
    import stat
    core.backing.inject("mknod", errno=errno.EPERM)
    core.cache.names.mknod(core.cache.inodes.root, b"dev", stat.S_IFCHR | 0o600, os.makedev(1, 3), 0, 0)
    settled(core, refused=1)
    assert not (core.back / "dev").exists() and b"dev" in core.cache.inodes.root.children
