"""POSIX operations that checkpoint writers use, on a real mount, and what reaches the backing."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import acpfs, listing
from trees import tree


def test_backing_tree_is_visible_and_readable(make_mount, tmp_path):
    m = make_mount(mount=False)
    (m.back / "d" / "e").mkdir(parents=True)
    (m.back / "d" / "e" / "f.bin").write_bytes(os.urandom(3 << 20))
    (m.back / "top.txt").write_text("hello")
    os.symlink("top.txt", m.back / "ln")
    os.chmod(m.back / "top.txt", 0o640)
    m.mount()
    assert tree(m.mnt) == tree(m.back)
    assert (m.mnt / "d/e/f.bin").read_bytes() == (m.back / "d/e/f.bin").read_bytes()
    assert stat.S_IMODE(os.stat(m.mnt / "top.txt").st_mode) == 0o640
    assert os.readlink(m.mnt / "ln") == "top.txt"


def test_write_read_back_at_once_and_persisted_after_close(mnt):
    data = os.urandom(5 * 1024 * 1024 + 123)
    with open(mnt.mnt / "f", "wb") as f:
        f.write(data)
        assert mnt.state("f") == "dirty"
        # visible to another reader before close
        assert (mnt.mnt / "f").read_bytes() == data
        assert not (mnt.back / "f").exists()
    mnt.sync("f")
    assert (mnt.back / "f").read_bytes() == data
    assert mnt.state("f") == "persisted"


def test_create_exclusive_and_trunc(mnt):
    p = mnt.mnt / "x"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, b"first version, long")
    os.close(fd)
    with pytest.raises(FileExistsError):
        os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    fd = os.open(p, os.O_TRUNC | os.O_WRONLY)
    os.write(fd, b"second")
    os.close(fd)
    assert p.read_bytes() == b"second"
    mnt.sync()
    assert (mnt.back / "x").read_bytes() == b"second"


def test_random_writes_and_reads(mnt):
    rng = __import__("random").Random(7)
    size = 3 * 1024 * 1024
    ref = bytearray(size)
    p = mnt.mnt / "rand"
    with open(p, "wb") as f:
        f.truncate(size)
    with open(p, "r+b") as f:
        for _ in range(300):
            off = rng.randrange(0, size + 200000)
            chunk = os.urandom(rng.randrange(1, 200000))
            f.seek(off)
            f.write(chunk)
            end = off + len(chunk)
            if end > len(ref):
                ref.extend(bytes(end - len(ref)))
            ref[off:end] = chunk
            if rng.random() < 0.2:
                f.flush()
                roff = rng.randrange(0, len(ref))
                with open(p, "rb") as r:
                    r.seek(roff)
                    assert r.read(70000) == bytes(ref[roff:roff + 70000])
    assert p.read_bytes() == bytes(ref)
    mnt.sync()
    assert (mnt.back / "rand").read_bytes() == bytes(ref)


def test_overwrite_in_place_without_truncate(make_mount):
    m = make_mount(mount=False)
    (m.back / "latest").write_bytes(b"global_step1000\n")
    m.mount()
    with open(m.mnt / "latest", "r+b") as f:
        f.write(b"global_step2000")
    assert (m.mnt / "latest").read_bytes() == b"global_step2000\n"
    m.sync()
    assert (m.back / "latest").read_bytes() == b"global_step2000\n"


def test_truncate_and_ftruncate(mnt):
    p = mnt.mnt / "t"
    p.write_bytes(b"a" * 200000)
    os.truncate(p, 70000)       # path-based, no open handle
    assert p.read_bytes() == b"a" * 70000
    with open(p, "r+b") as f:
        f.truncate(100000)      # grows with zeros
    assert p.read_bytes() == b"a" * 70000 + bytes(30000)
    mnt.sync()
    assert (mnt.back / "t").read_bytes() == b"a" * 70000 + bytes(30000)


def test_fsync_and_fdatasync_memory_mode_return(mnt):
    with open(mnt.mnt / "f", "wb") as f:
        f.write(b"x" * 1000)
        os.fsync(f.fileno())
        os.fdatasync(f.fileno())
    mnt.sync()
    assert (mnt.back / "f").read_bytes() == b"x" * 1000


def test_fsync_backing_mode_waits_for_durability(make_mount):
    m = make_mount(extra=("--fsync", "backing"))
    with open(m.mnt / "f", "wb") as f:
        f.write(b"durable" * 1000)
        f.flush()
        os.fsync(f.fileno())
        # fsync returned: the data written so far is in the backing, complete
        assert (m.back / "f").read_bytes() == b"durable" * 1000
        f.write(b"more")
    m.sync()
    assert (m.back / "f").read_bytes() == b"durable" * 1000 + b"more"


def test_rename_over_existing_and_of_dir_with_dirty_files(mnt):
    (mnt.mnt / "a").write_bytes(b"A")
    (mnt.mnt / "b").write_bytes(b"B")
    os.rename(mnt.mnt / "a", mnt.mnt / "b")
    assert (mnt.mnt / "b").read_bytes() == b"A"
    assert not (mnt.mnt / "a").exists()
    d = mnt.mnt / "dir"
    d.mkdir()
    with open(d / "open", "wb") as f:
        f.write(b"written before the rename")
        os.rename(d, mnt.mnt / "dir2")
        f.write(b", closed after")
    (mnt.mnt / "dir2" / "closed").write_bytes(b"c")
    os.rename(mnt.mnt / "dir2", mnt.mnt / "dir3")
    mnt.sync()
    assert tree(mnt.back) == tree(mnt.mnt)
    assert (mnt.back / "dir3" / "open").read_bytes() == b"written before the rename, closed after"
    assert not (mnt.back / "dir").exists() and not (mnt.back / "dir2").exists()


def test_rename_noreplace(mnt):
    (mnt.mnt / "a").write_bytes(b"A")
    (mnt.mnt / "b").write_bytes(b"B")
    subprocess.run(["mv", "-n", str(mnt.mnt / "a"), str(mnt.mnt / "b")])
    assert (mnt.mnt / "b").read_bytes() == b"B"
    assert (mnt.mnt / "a").read_bytes() == b"A"


def test_unlink_open_file_keeps_content_for_the_holder(mnt):
    p = mnt.mnt / "u"
    p.write_bytes(b"old")
    mnt.sync()
    f = open(p, "r+b")
    try:
        os.unlink(p)
        assert not p.exists()
        f.write(b"new data after unlink")
        f.flush()
        f.seek(0)
        assert f.read() == b"new data after unlink"
    finally:
        f.close()
    mnt.sync()
    assert not (mnt.back / "u").exists()


def test_mkdir_p_rmdir_and_recursive_delete(mnt):
    deep = mnt.mnt / "a" / "b" / "c" / "d"
    subprocess.run(["mkdir", "-p", str(deep)], check=True)
    for i in range(20):
        (deep / f"f{i}").write_bytes(os.urandom(1000))
    (mnt.mnt / "empty").mkdir()
    os.rmdir(mnt.mnt / "empty")
    with pytest.raises(OSError) as e:
        os.rmdir(mnt.mnt / "a")
    assert e.value.errno == errno.ENOTEMPTY
    mnt.sync()
    assert len(list((mnt.back / "a/b/c/d").iterdir())) == 20
    subprocess.run(["rm", "-rf", str(mnt.mnt / "a")], check=True)
    assert not (mnt.mnt / "a").exists()
    mnt.sync()
    assert not (mnt.back / "a").exists() and not (mnt.back / "empty").exists()


def test_recursive_delete_of_backing_tree(make_mount):
    m = make_mount(mount=False)
    for i in range(5):
        d = m.back / f"ckpt-{i}"
        d.mkdir()
        (d / "model.bin").write_bytes(os.urandom(10000))
    m.mount()
    for i in range(4):
        shutil.rmtree(m.mnt / f"ckpt-{i}")
    m.sync()
    assert listing(m.back) == ["ckpt-4"]


def test_symlinks(mnt):
    (mnt.mnt / "target").write_bytes(b"t")
    os.symlink("target", mnt.mnt / "rel")
    os.symlink("/etc/hostname", mnt.mnt / "abs")
    os.symlink("missing", mnt.mnt / "dangling")
    assert os.readlink(mnt.mnt / "rel") == "target"
    assert (mnt.mnt / "rel").read_bytes() == b"t"
    mnt.sync()
    assert os.readlink(mnt.back / "abs") == "/etc/hostname"
    assert os.readlink(mnt.back / "dangling") == "missing"
    assert tree(mnt.back) == tree(mnt.mnt)


def test_chmod_chown_utimens(mnt):
    p = mnt.mnt / "f"
    p.write_bytes(b"x")
    (mnt.mnt / "d").mkdir()
    mnt.sync()
    os.chmod(p, 0o600)
    os.chmod(mnt.mnt / "d", 0o750)
    os.chown(p, 1234, 5678)
    os.utime(p, ns=(1_000_000_000_000_000_000, 1_500_000_000_123_456_789))
    st = os.stat(p)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 1234, 5678)
    assert st.st_mtime_ns == 1_500_000_000_123_456_789
    mnt.sync()
    bst = os.stat(mnt.back / "f")
    assert (stat.S_IMODE(bst.st_mode), bst.st_uid, bst.st_gid) == (0o600, 1234, 5678)
    assert bst.st_mtime_ns == 1_500_000_000_123_456_789
    assert stat.S_IMODE(os.stat(mnt.back / "d").st_mode) == 0o750


def test_new_files_keep_creator_and_mode_in_backing(mnt):
    fd = os.open(mnt.mnt / "m", os.O_CREAT | os.O_WRONLY, 0o640)
    os.write(fd, b"x")
    os.close(fd)
    mnt.sync()
    assert stat.S_IMODE(os.stat(mnt.back / "m").st_mode) == 0o640 & ~current_umask()


def current_umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def test_statfs_reports_the_backing(mnt):
    a, b = os.statvfs(mnt.mnt), os.statvfs(mnt.back)
    assert a.f_blocks == b.f_blocks and a.f_bsize == b.f_bsize


def test_user_xattrs(mnt):
    p = mnt.mnt / "x"
    p.write_bytes(b"x")
    os.setxattr(p, "user.checkpoint", b"step-10")
    assert os.getxattr(p, "user.checkpoint") == b"step-10"
    assert "user.checkpoint" in os.listxattr(p)
    mnt.sync()
    try:
        assert os.getxattr(mnt.back / "x", "user.checkpoint") == b"step-10"
    except OSError as e:  # a backing without user xattrs keeps them in the mount only
        assert e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)
    os.removexattr(p, "user.checkpoint")
    assert "user.checkpoint" not in os.listxattr(p)
    with pytest.raises(OSError) as e:
        os.setxattr(p, "user.acpfs.state", b"persisted")
    assert e.value.errno == errno.EPERM


def test_o_append(mnt):
    p = mnt.mnt / "log"
    for i in range(50):
        with open(p, "a") as f:
            f.write(f"line {i}\n")
    fd1 = os.open(p, os.O_WRONLY | os.O_APPEND)
    fd2 = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(fd1, b"from fd1\n")
    os.write(fd2, b"from fd2\n")
    os.close(fd1)
    os.close(fd2)
    expect = "".join(f"line {i}\n" for i in range(50)) + "from fd1\nfrom fd2\n"
    assert p.read_text() == expect
    mnt.sync()
    assert (mnt.back / "log").read_text() == expect


def test_shell_tools_cp_dd(mnt, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(20 << 20))
    subprocess.run(["cp", str(src), str(mnt.mnt / "copy.bin")], check=True)
    subprocess.run(["dd", f"if={src}", f"of={mnt.mnt / 'dd.bin'}", "bs=1M", "status=none"], check=True)
    subprocess.run(["cp", "-r", str(mnt.mnt), str(tmp_path / "out")], check=True)
    mnt.sync()
    for name in ("copy.bin", "dd.bin"):
        assert (mnt.back / name).read_bytes() == src.read_bytes()
        assert (tmp_path / "out" / name).read_bytes() == src.read_bytes()


def test_read_of_evicted_file_comes_from_backing(make_mount):
    m = make_mount(cache_size="16M")
    first = os.urandom(12 << 20)
    (m.mnt / "first").write_bytes(first)
    m.sync()
    for i in range(3):   # pushes "first" out of the 16 MiB cache
        (m.mnt / f"other{i}").write_bytes(os.urandom(8 << 20))
        m.sync()
    assert m.status()["cache"]["used_bytes"] <= 16 << 20
    assert (m.mnt / "first").read_bytes() == first
    with open(m.mnt / "first", "r+b") as f:   # copied back in for writing
        f.seek(100)
        f.write(b"patched")
    m.sync()
    assert (m.back / "first").read_bytes() == first[:100] + b"patched" + first[107:]


def test_every_change_visible_to_other_processes(mnt):
    (mnt.mnt / "f").write_bytes(b"v1")
    out = subprocess.run(["cat", str(mnt.mnt / "f")], capture_output=True, check=True).stdout
    assert out == b"v1"
    with open(mnt.mnt / "f", "wb") as f:
        f.write(b"v2-longer")
        f.flush()
        out = subprocess.run(["cat", str(mnt.mnt / "f")], capture_output=True, check=True).stdout
        assert out == b"v2-longer"


def test_a_name_longer_than_255_bytes_is_too_long_on_lookup_too(mnt):
    """(Errors as on ext4.) ENAMETOOLONG, as on ext4, not ENOENT."""
    for path in (mnt.mnt / ("n" * 256), mnt.mnt / ("é" * 128)):
        with pytest.raises(OSError) as e:
            os.stat(path)
        assert e.value.errno == errno.ENAMETOOLONG
    os.stat(mnt.mnt)
    assert not (mnt.mnt / ("n" * 255)).exists()


def test_a_directorys_link_count_counts_its_subdirectories(mnt):
    """(Link counts as on ext4.) 2 + subdirectories, as on ext4 (find's leaf optimisation and
    pjdfstest rely on it)."""
    d = mnt.mnt / "d"
    d.mkdir()
    assert os.stat(d).st_nlink == 2
    for name in ("a", "b", "c"):
        (d / name).mkdir()
    (d / "file").write_bytes(b"x")
    os.symlink("a", d / "link")
    assert os.stat(d).st_nlink == 5
    os.rmdir(d / "c")
    os.rename(d / "b", mnt.mnt / "b")
    assert os.stat(d).st_nlink == 3
    assert os.stat(mnt.mnt).st_nlink == 4          # d and b below the root


def test_fifos_sockets_and_device_nodes(make_mount, faults):
    """(Every file type a local filesystem has.) mknod makes FIFOs, sockets, device nodes and
    empty regular files; they land in the backing with their type, device number, owner and mode
    (made under a temporary name, then renamed: never seen with another mode), follow chmod,
    chown, utime, rename and unlink, work as what they are through the mount (a FIFO passes
    data), come back from the backing after a remount, and from the journal after the daemon is
    killed before they reached the backing."""
    import socket
    m = make_mount("nodes", cache_size="64M", mount=False)
    faults.tmpfs(m.back, "16M")
    faults.mount(m)
    mnt, back = m.mnt, m.back
    os.mkfifo(mnt / "fifo", 0o640)
    os.mknod(mnt / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(mnt / "loop", 0o660 | stat.S_IFBLK, os.makedev(7, 0))
    os.mknod(mnt / "empty", 0o644)                         # a regular file
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(mnt / "sock"))
    s.close()
    os.chown(mnt / "null", 65534, 65534)
    os.chmod(mnt / "loop", 0o600)
    os.utime(mnt / "fifo", ns=(10**18, 10**18))
    os.rename(mnt / "fifo", mnt / "pipe")
    os.mkfifo(mnt / "gone")
    os.unlink(mnt / "gone")
    want = {"pipe": (stat.S_IFIFO | 0o640, 0, 0), "null": (stat.S_IFCHR | 0o600, 65534, os.makedev(1, 3)),
            "loop": (stat.S_IFBLK | 0o600, 0, os.makedev(7, 0)), "empty": (stat.S_IFREG | 0o644, 0, 0),
            "sock": (stat.S_IFSOCK, 0, 0)}

    def check(root: Path) -> None:
        assert sorted(n for n in os.listdir(root) if not n.startswith(".acpfs")) == sorted(want)
        for name, (mode, uid, rdev) in want.items():
            st = os.lstat(root / name)
            if name == "sock":            # its mode is the binder's, less its umask
                assert stat.S_ISSOCK(st.st_mode), name
                continue
            assert (st.st_mode, st.st_uid, st.st_rdev) == (mode, uid, rdev), name
        assert os.lstat(root / "pipe").st_mtime_ns == 10**18
    check(mnt)
    m.sync()
    check(back)
    w = subprocess.Popen(["sh", "-c", f"echo through the pipe > {mnt / 'pipe'}"])
    with open(mnt / "pipe") as f:
        assert f.read() == "through the pipe\n"
    assert w.wait(10) == 0
    assert m.umount().returncode == 0
    m.mount()
    check(mnt)
    # killed before the backing had them: the journal brings them back
    faults.remount(back, "ro")
    os.mkfifo(mnt / "late-fifo", 0o600)
    os.mknod(mnt / "late-dev", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    want["late-fifo"] = (stat.S_IFIFO | 0o600, 0, 0)
    want["late-dev"] = (stat.S_IFCHR | 0o600, 0, os.makedev(1, 5))
    time.sleep(0.5)
    os.kill(m.pid, signal.SIGKILL)
    faults.remount(back, "rw")
    acpfs(*m.args(), check=False)
    m.pid = m.status()["pid"]
    m.sync()
    check(back)
    check(mnt)


def test_fallocate_extends_keeps_size_and_refuses_holes(make_mount):
    """(fallocate as on ext4.) pyfuse3 has no FALLOCATE handler (the kernel got ENOSYS and
    refused fallocate on the whole mount); the C extension answers it. Mode 0 extends the
    file (zeros), FALLOC_FL_KEEP_SIZE succeeds without changing it, hole punching fails with
    EOPNOTSUPP; posix_fallocate works; the bytes and size land in the backing."""
    m = make_mount(cache_size="64M")
    f = m.mnt / "pre"
    f.write_bytes(b"head")
    assert subprocess.run(["fallocate", "-l", "1MiB", str(f)]).returncode == 0
    assert f.stat().st_size == 1 << 20
    assert subprocess.run(["fallocate", "-n", "-l", "4MiB", str(f)]).returncode == 0
    assert f.stat().st_size == 1 << 20
    r = subprocess.run(["fallocate", "-p", "-o", "0", "-l", "4096", str(f)], capture_output=True, text=True)
    assert r.returncode != 0 and "unsupported" in r.stderr
    fd = os.open(m.mnt / "posix", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, 3 << 20)
        os.pwrite(fd, b"tail", (3 << 20) - 4)
    finally:
        os.close(fd)
    want = {"pre": b"head" + bytes((1 << 20) - 4), "posix": bytes((3 << 20) - 4) + b"tail"}
    for name, data in want.items():
        assert (m.mnt / name).read_bytes() == data
    m.sync()
    for name, data in want.items():
        assert (m.back / name).read_bytes() == data
