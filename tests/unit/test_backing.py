"""Backing: temporary files that nobody can predict or adopt, that a daemon tells apart from
everyone else's, directories that appear with their final mode (contract 9), and paths
opened in one call as the walk from the root opens them."""

from __future__ import annotations

import errno
import os
import random
import re
import stat

import pytest

from acpfs.backing import root as root_mod
from acpfs.backing.backing import (TEMP_PREFIX, Backing, is_internal_name, new_instance, staged_ino,
                           staging_dir_of)
from acpfs.backing.names import MissingDir

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


def _outcome(fn):
    """What a call gave: the (device, inode) it opened, or its error's kind and details."""
    try:
        fd = fn()
    except MissingDir as e:
        return ("missing", e.depth, e.blocked)
    except OSError as e:
        return ("error", type(e).__name__, e.errno)
    try:
        st = os.fstat(fd)
        return ("opened", st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode),
                os.get_inheritable(fd))
    finally:
        os.close(fd)


def test_a_path_opened_in_one_call_is_what_the_walk_opens(back, tmp_path):
    """RootDir: openat2 (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) promises what the walk from the
    root does, on random trees with files, symlinks (inside, outside, to files, dangling) and
    missing names: the same directory or file opened, or the same MissingDir (depth,
    blocked) or errno; and ``stat_entry`` (the entry opened O_PATH in one call) the same lstat
    as from the directory opened by the walk, or None alike."""
    if not root_mod.HAVE_BENEATH:
        pytest.skip("acpfs.backing._beneath is not built")
    assert back.beneath
    rng = random.Random(7)
    root = tmp_path / "back"
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    names = [b"a", b"b", b"c", b"l", b"f"]
    dirs = [root]
    for _ in range(60):
        parent = rng.choice(dirs)
        name = os.fsdecode(rng.choice(names)) + str(rng.randrange(3))
        p = parent / name
        if os.path.lexists(p):
            continue
        kind = rng.choice(["dir", "dir", "file", "link_in", "link_out", "dangling"])
        if kind == "dir":
            p.mkdir()
            dirs.append(p)
        elif kind == "file":
            p.write_bytes(b"x")
        elif kind == "link_in":
            os.symlink(rng.choice(dirs), p)
        elif kind == "link_out":
            os.symlink(outside / "d", p)
        else:
            os.symlink(tmp_path / "nowhere", p)
    paths = [list(os.fsencode(d.relative_to(root)).split(b"/")) if d != root else [] for d in dirs]
    seen = set()
    stat_kinds: set = set()
    for _ in range(400):
        comps = list(rng.choice(paths))
        for _ in range(rng.randrange(3)):
            comps.append(os.fsencode(os.fsdecode(rng.choice(names)) + str(rng.randrange(3))))
        name = comps.pop() if comps and rng.random() < 0.5 else None
        outcomes = []
        for beneath in (True, False):
            back.beneath = beneath
            if name is None:
                outcomes.append(_outcome(lambda: back.open_dir(comps)))
            else:
                outcomes.append(_outcome(lambda: back.open_in(comps, name, os.O_RDONLY | os.O_NONBLOCK)))
        assert outcomes[0] == outcomes[1], (comps, name)
        seen.add(outcomes[0][0])
        if name is not None:   # an lstat: the entry opened O_PATH, or the directory walked
            stats = []
            for beneath in (True, False):
                back.beneath = beneath
                st = back.stat_entry(comps, name)
                stats.append(None if st is None else (st.st_ino, st.st_mode, st.st_size,
                                                      st.st_mtime_ns))
            assert stats[0] == stats[1], (comps, name)
            stat_kinds.add("missing" if stats[0] is None else stat.S_IFMT(stats[0][1]))
    assert seen == {"opened", "missing", "error"}   # the random trees reached every outcome
    assert stat_kinds == {"missing", stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK}, stat_kinds
    back.beneath = True
    with pytest.raises(OSError) as e:
        back.open_dir([b".."])
    assert e.value.errno == errno.EINVAL              # names are checked before any call
