"""Backing: temporary files that nobody can predict or adopt, that a daemon tells apart from
everyone else's, and directories that appear with their final mode (contract 9)."""

from __future__ import annotations

import errno
import os
import re
import stat

import pytest

from acpfs.backing.backing import (TEMP_PREFIX, Backing, is_internal_name, new_instance, staged_ino,
                           staging_dir_of)

NAME = re.compile(rb"\.acpfs-tmp-([0-9a-f]{12})-([0-9a-f]{16})")


@pytest.fixture
def back(tmp_path):
    root = tmp_path / "back"
    root.mkdir()
    b = Backing(str(root))
    yield b
    b.close()


def test_temporary_names_carry_the_instance_and_64_random_bits(back):
    names = {back.temp_name() for _ in range(1000)}
    assert len(names) == 1000
    for n in names:
        m = NAME.fullmatch(n)
        assert m and m.group(1).decode() == back.instance and is_internal_name(n)
    assert new_instance() != new_instance()
    staged = back.staged_name(4711)
    assert staged.startswith(back.mine) and staged_ino(staged) == 4711
    assert staging_dir_of(staged) == back.staging_dir == TEMP_PREFIX + back.instance.encode() + b"-staging"
    # an upload's temporary name is no staged file's
    assert staged_ino(back.temp_name()) is None
    with pytest.raises(ValueError):
        staging_dir_of(back.temp_name())


def test_a_temporary_file_is_created_exclusively_and_privately(back, tmp_path):
    dfd = back.open_dir([])
    try:
        name = back.temp_name()
        (tmp_path / "back" / os.fsdecode(name)).write_bytes(b"someone else's")
        with pytest.raises(FileExistsError):
            back.create_temp(dfd, name)              # never opens a file it did not create
        assert (tmp_path / "back" / os.fsdecode(name)).read_bytes() == b"someone else's"
        mine = back.temp_name()
        fd = back.create_temp(dfd, mine)
        os.close(fd)
        assert stat.S_IMODE(os.stat(tmp_path / "back" / os.fsdecode(mine)).st_mode) == 0o600
    finally:
        os.close(dfd)


def test_listing_removes_only_the_dead_daemons_leftovers(tmp_path):
    root = tmp_path / "back"
    root.mkdir()
    dead = Backing(str(root))
    theirs = Backing(str(root))                      # another node's daemon, alive
    leftovers = [dead.temp_name(), dead.temp_name()]
    in_flight = theirs.temp_name()
    for n in leftovers + [in_flight]:
        (root / os.fsdecode(n)).write_bytes(b"x")
    (root / os.fsdecode(dead.temp_name())).mkdir()   # a mkdir the dead daemon cut short
    (root / "f").write_bytes(b"f")
    new = Backing(str(root), dead_instance=dead.instance)
    try:
        assert [e[0] for e in new.listdir([])] == [b"f"]
        assert sorted(os.listdir(root)) == sorted(["f", os.fsdecode(in_flight)])
    finally:
        for b in (dead, theirs, new):
            b.close()


def test_rmdir_removes_own_temporary_files_and_refuses_another_daemons(tmp_path):
    root = tmp_path / "back"
    (root / "d").mkdir(parents=True)
    me, other = Backing(str(root)), Backing(str(root))
    try:
        (root / "d" / os.fsdecode(me.temp_name())).write_bytes(b"mine")
        (root / "d" / os.fsdecode(other.temp_name())).write_bytes(b"an upload in flight")
        with pytest.raises(OSError) as e:
            me.unlink([], b"d", is_dir=True)
        assert e.value.errno == errno.ENOTEMPTY
        assert [n.startswith(os.fsdecode(other.mine)) for n in os.listdir(root / "d")] == [True]
        other.unlink([], b"d", is_dir=True)          # its owner may
        assert not (root / "d").exists()
    finally:
        me.close()
        other.close()


def test_mkdir_lands_with_its_mode_and_owner_at_once(back, tmp_path):
    root = tmp_path / "back"
    back.mkdir([], b"d", 0o40751, os.getuid(), os.getgid())
    assert stat.S_IMODE(os.stat(root / "d").st_mode) == 0o751
    assert os.listdir(root) == ["d"]                 # made under a temporary name, renamed
    (root / "e").mkdir(mode=0o700)
    back.mkdir([], b"e", 0o40755, os.getuid(), os.getgid())   # exists: takes the mode
    assert stat.S_IMODE(os.stat(root / "e").st_mode) == 0o755
    (root / "f").write_bytes(b"a file")
    with pytest.raises(OSError) as e:
        back.mkdir([], b"f", 0o40755, os.getuid(), os.getgid())
    assert e.value.errno == errno.EEXIST and (root / "f").read_bytes() == b"a file"
    assert sorted(os.listdir(root)) == ["d", "e", "f"]
