"""Hard links on a real mount (docs/semantics.md, "Hard links"): one
file under several names in the mount, persisted as links to one inode in the backing, in
order with every other change; `cp -al`, rename and unlink of linked names, a daemon killed
with SIGKILL before they were persisted, a second node over the same backing, and a backing
that refuses hard links."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import time

from conftest import acpfs, wait_for


def inodes(*paths) -> set[int]:
    return {os.lstat(p).st_ino for p in paths}


def test_one_file_under_every_name_in_the_mount_and_in_the_backing(mnt):
    m, b = mnt.mnt, mnt.back
    (m / "a").write_bytes(b"one")
    os.link(m / "a", m / "b")
    (m / "d").mkdir()
    os.link(m / "b", m / "d" / "c")
    assert len(inodes(m / "a", m / "b", m / "d" / "c")) == 1
    assert os.stat(m / "a").st_nlink == 3
    with open(m / "b", "ab") as f:                       # written under one name ...
        f.write(b" two")
    assert (m / "a").read_bytes() == (m / "d" / "c").read_bytes() == b"one two"   # ... seen under all
    mnt.sync()
    names = [b / "a", b / "b", b / "d" / "c"]
    assert len(inodes(*names)) == 1, "not links to one inode in the backing"
    assert os.stat(b / "a").st_nlink == 3
    assert all(p.read_bytes() == b"one two" for p in names)

    # a new version lands under every name, still one inode there
    (m / "d" / "c").write_bytes(b"three")                # O_TRUNC through the third name
    mnt.sync()
    assert len(inodes(*names)) == 1 and all(p.read_bytes() == b"three" for p in names)

    # unlink one name: the others keep the file; rename another
    os.unlink(m / "a")
    assert os.stat(m / "b").st_nlink == 2 and (m / "b").read_bytes() == b"three"
    os.rename(m / "d" / "c", m / "e")
    os.rename(m / "b", m / "e")                          # two names of one file: nothing happens
    assert sorted(os.listdir(m)) == ["b", "d", "e"]
    mnt.sync()
    assert not (b / "a").exists() and not (b / "d" / "c").exists()
    assert inodes(b / "b") == inodes(b / "e") and os.stat(b / "e").st_nlink == 2

    # symlinks and FIFOs can have several names too (the link itself, not its target)
    os.symlink("e", m / "s")
    os.link(m / "s", m / "s2", follow_symlinks=False)
    os.mkfifo(m / "p")
    os.link(m / "p", m / "p2")
    mnt.sync()
    assert os.readlink(b / "s2") == "e" and inodes(b / "s", b / "s2") != inodes(b / "e")
    assert len(inodes(b / "s", b / "s2")) == 1 and len(inodes(b / "p", b / "p2")) == 1
    assert stat.S_ISFIFO(os.lstat(b / "p2").st_mode)

    # the last name gone, the file is gone
    os.unlink(m / "b")
    os.unlink(m / "e")
    mnt.sync()
    assert not (b / "b").exists() and not (b / "e").exists()
    assert mnt.status()["conflicts"]["total"] == 0


def test_errors_are_those_of_link_2(mnt):
    m = mnt.mnt
    (m / "f").write_bytes(b"x")
    (m / "d").mkdir()
    for src, dst, code in ((m / "d", m / "d2", errno.EPERM),          # a directory
                           (m / "f", m / "d", errno.EEXIST),
                           (m / "missing", m / "g", errno.ENOENT),
                           (m / "f", m / "nodir" / "g", errno.ENOENT),
                           (m / "f", m / ("n" * 256), errno.ENAMETOOLONG),
                           (m / "f", m / ".acpfs-tmp-mine", errno.EPERM)):   # reserved
        try:
            os.link(src, dst)
        except OSError as e:
            assert e.errno == code, (src, dst, e)
        else:
            raise AssertionError(f"link {src} {dst} succeeded")
    assert os.stat(m / "f").st_nlink == 1


def test_cp_al_checkpoint_rotation_lands_as_links(mnt):
    """The rsync --link-dest pattern of checkpoint tools: the next step starts as `cp -al`
    of the last one (unchanged shards are links), the changed shards are written anew
    (unlinked first, so the old step keeps its version), then `latest` names it."""
    m, b = mnt.mnt, mnt.back
    (m / "step_1").mkdir()
    shards = {f"shard_{i}.bin": os.urandom(300_000 + i) for i in range(4)}
    for name, data in shards.items():
        (m / "step_1" / name).write_bytes(data)
    (m / "latest").write_text("step_1")
    subprocess.run(["cp", "-al", str(m / "step_1"), str(m / "step_2")], check=True)
    new = os.urandom(123_456)
    os.unlink(m / "step_2" / "shard_3.bin")
    (m / "step_2" / "shard_3.bin").write_bytes(new)
    with open(m / "latest.tmp", "w") as f:
        f.write("step_2")
    os.rename(m / "latest.tmp", m / "latest")
    mnt.sync()
    assert (b / "latest").read_text() == "step_2"
    for name, data in shards.items():
        assert (b / "step_1" / name).read_bytes() == data
        if name != "shard_3.bin":
            assert inodes(b / "step_1" / name, b / "step_2" / name).__len__() == 1, name
            assert os.stat(b / "step_2" / name).st_nlink == 2
    assert (b / "step_2" / "shard_3.bin").read_bytes() == new
    assert os.stat(b / "step_1" / "shard_3.bin").st_nlink == 1
    # rotation: the old step removed, the links of the new one stay
    subprocess.run(["rm", "-rf", str(m / "step_1")], check=True)
    mnt.sync()
    assert not (b / "step_1").exists()
    for name in shards:
        assert os.stat(b / "step_2" / name).st_nlink == 1


def test_links_made_before_a_sigkill_are_replayed(make_mount):
    """The links, and a new version written through one name, were acknowledged while the
    backing refused every change (read-only); the daemon is killed; the next mount replays
    the journal and the backing ends with one inode under every name."""
    m = make_mount(mount=False)
    subprocess.run(["mount", "--bind", str(m.back), str(m.back)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(m.back)], check=True)
        m.mount()
        (m.mnt / "d").mkdir()
        (m.mnt / "d" / "f").write_bytes(b"first")
        os.link(m.mnt / "d" / "f", m.mnt / "g")
        os.link(m.mnt / "g", m.mnt / "d" / "h")
        os.unlink(m.mnt / "d" / "f")                    # the first name goes, the others stay
        with open(m.mnt / "g", "ab") as f:
            f.write(b" second")
        time.sleep(0.5)                                  # RELEASE: its publish is journaled
        os.kill(m.pid, signal.SIGKILL)
        time.sleep(0.3)
    finally:
        subprocess.run(["umount", "-l", str(m.back)], check=True)
    acpfs(*m.args())
    m.pid = m.status()["pid"]
    m.sync()
    b = m.back
    assert not (b / "d" / "f").exists()
    assert (b / "g").read_bytes() == (b / "d" / "h").read_bytes() == b"first second"
    assert len(inodes(b / "g", b / "d" / "h")) == 1 and os.stat(b / "g").st_nlink == 2
    assert os.stat(m.mnt / "d" / "h").st_nlink == 2


def test_a_second_node_sees_one_file_and_writes_it_under_every_name(make_nodes):
    a, b = make_nodes(2)
    (a.path("ckpt")).mkdir()
    a.path("ckpt/model.bin").write_bytes(b"v1" * 1000)
    os.link(a.path("ckpt/model.bin"), a.path("best.bin"))
    a.sync()
    # node b lists the backing: both names are one file there, so one file in its view
    assert b.path("ckpt/model.bin").read_bytes() == b"v1" * 1000
    assert os.stat(b.path("best.bin")).st_nlink == 2
    assert inodes(b.path("ckpt/model.bin"), b.path("best.bin")).__len__() == 1
    with open(b.path("best.bin"), "r+b") as f:          # rewritten in place through one name
        f.write(b"v2" * 1000)
    b.sync()
    back = a.backing
    assert (back / "ckpt/model.bin").read_bytes() == (back / "best.bin").read_bytes() == b"v2" * 1000
    assert len(inodes(back / "ckpt/model.bin", back / "best.bin")) == 1
    # node a sees the new version under both names (close-to-open, at its next open)
    wait_for(lambda: a.path("best.bin").read_bytes() == b"v2" * 1000, 10, "node a sees best.bin")
    wait_for(lambda: a.path("ckpt/model.bin").read_bytes() == b"v2" * 1000, 10, "... and model.bin")
    wait_for(lambda: os.stat(a.path("best.bin")).st_nlink == 2
             and len(inodes(a.path("best.bin"), a.path("ckpt/model.bin"))) == 1, 10,
             "node a: still one file under both names")

    # another program replaces one name in the backing: the link is split there, so the
    # names are two files on both nodes from then on (within the coherence timeout: until
    # then the file may be read through the name that changed, docs/semantics.md)
    (back / "best.new").write_bytes(b"other")
    os.replace(back / "best.new", back / "best.bin")
    for n in (a, b):
        wait_for(lambda: n.path("best.bin").read_bytes() == b"other"
                 and n.path("ckpt/model.bin").read_bytes() == b"v2" * 1000
                 and os.stat(n.path("ckpt/model.bin")).st_nlink == 1, 10, f"{n.name} sees the split")
        assert len(inodes(n.path("best.bin"), n.path("ckpt/model.bin"))) == 2
    for n in (a, b):
        assert n.status()["conflicts"]["total"] == 0, n.status()["conflicts"]


def test_a_backing_that_refuses_hard_links_keeps_the_queue_moving(make_mount, faults, tmp_path):
    """The backing answers link(2) with EPERM (faultfs does, like some network filesystems):
    the name stays in the mount, a conflict ``refused`` says so, later changes land."""
    m = make_mount("refuses", mount=False)
    src = tmp_path / "refuses-src"
    faults.shim(src, m.back)
    faults.mount(m)
    (m.mnt / "f").write_bytes(b"data")
    os.link(m.mnt / "f", m.mnt / "g")
    (m.mnt / "after").write_bytes(b"later change")
    m.sync()
    assert (src / "f").read_bytes() == b"data" and (src / "after").read_bytes() == b"later change"
    assert not (src / "g").exists()
    assert (m.mnt / "g").read_bytes() == b"data"
    st = m.status()
    assert st["conflicts"]["by_kind"]["refused"] == 1, st["conflicts"]
    assert any("links this file" in c["ours"] for c in st["conflicts"]["recent"]), st["conflicts"]
    # the name the backing has goes: the file moves to the name the mount keeps, never lost
    os.unlink(m.mnt / "f")
    m.sync()
    assert not (src / "f").exists() and (src / "g").read_bytes() == b"data"
    m.umount()
    m.mount()
    assert (m.mnt / "g").read_bytes() == b"data" and not (m.mnt / "f").exists()
