"""Recovery edge cases found in review: renames applied after a close, directories not yet
listed, the journal cut back while files are open, a smaller cache at the remount, and a
daemon killed in the middle of a replay."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from conftest import acpfs, staged_files


def _kill(m):
    os.kill(m.pid, signal.SIGKILL)
    time.sleep(0.3)


def _remount(m, check=True):
    r = acpfs(*m.args(), check=check)
    if r.returncode == 0:
        m.pid = m.status()["pid"]
    return r


def _ro(m):
    subprocess.run(["mount", "--bind", str(m.back), str(m.back)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(m.back)], check=True)


def _unro(m):
    subprocess.run(["umount", "-l", str(m.back)], check=True)


def test_rename_after_flush_of_dup_fd(make_mount):
    """close() acknowledged the content (FLUSH), then the file is renamed; the flusher
    applies the rename (a no-op for a never-saved file); kill before RELEASE."""
    m = make_mount()
    fd = os.open(m.mnt / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"hello")
    fd2 = os.dup(fd)
    os.close(fd)                       # FLUSH: content acknowledged
    os.rename(m.mnt / "f", m.mnt / "g")
    time.sleep(0.5)                    # the rename is applied: applied >= its seq
    _kill(m)
    try:
        os.close(fd2)
    except OSError:
        pass
    _remount(m)
    m.sync()
    assert not (m.back / "f").exists()
    assert (m.back / "g").read_bytes() == b"hello"


def test_dir_rename_after_flush_of_dup_fd(make_mount):
    m = make_mount()
    (m.mnt / "d").mkdir()
    m.sync()
    fd = os.open(m.mnt / "d" / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"hello")
    fd2 = os.dup(fd)
    os.close(fd)                       # FLUSH: content acknowledged
    os.rename(m.mnt / "d", m.mnt / "e")
    time.sleep(0.5)
    _kill(m)
    try:
        os.close(fd2)
    except OSError:
        pass
    _remount(m)
    m.sync()
    assert (m.back / "e" / "f").read_bytes() == b"hello"


def test_replay_rmdir_of_unloaded_dir(make_mount):
    m = make_mount(mount=False)
    (m.back / "d").mkdir()
    _ro(m)
    try:
        m.mount()
        (m.mnt / "f").write_bytes(b"data")   # acknowledged, pending (read-only backing)
        (m.mnt / "d").rmdir()                # acknowledged, pending
        _kill(m)
    finally:
        _unro(m)
    r = _remount(m, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    m.sync()
    assert (m.back / "f").read_bytes() == b"data"
    assert not (m.back / "d").exists()



def test_replay_rename_over_unloaded_empty_dir(make_mount):
    m = make_mount(mount=False)
    (m.back / "a").mkdir()
    (m.back / "b").mkdir()
    _ro(m)
    try:
        m.mount()
        os.rename(m.mnt / "a", m.mnt / "b")
        _kill(m)
    finally:
        _unro(m)
    r = _remount(m, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    m.sync()
    assert not (m.back / "a").exists() and (m.back / "b").is_dir()


def test_journal_cut_back_keeps_records_of_open_files(make_mount):
    m = make_mount(extra=("--persist-open-after", "1"))
    (m.mnt / "model.bin").write_bytes(b"complete" * 1000)
    m.sync()
    f = open(m.mnt / "model.bin", "r+b")
    f.write(b"PARTIAL!")
    f.flush()
    deadline = time.time() + 20
    while not any(p.stat().st_size == 8000 for p in staged_files(m.back)):
        assert time.time() < deadline
        time.sleep(0.1)
    (m.mnt / "other").write_bytes(b"x")   # a publish applied with the queue then empty: reset
    deadline = time.time() + 20
    while m.state("other") != "persisted":   # no subprocess: a fork+exec would FLUSH f
        assert time.time() < deadline
        time.sleep(0.1)
    time.sleep(0.3)
    _kill(m)
    try:
        f.close()
    except OSError:
        pass
    _remount(m)
    m.sync()
    rec = m.status()["recovery"]
    assert rec and len(rec["kept_aside"]) == 1, rec
    assert rec["lost_open_files"] == [] and "model.bin" in rec["kept_aside"][0]


def test_recovery_with_smaller_cache_size(make_mount):
    m = make_mount(mount=False, cache_size="64M")
    files = {f"f{i}": os.urandom(3 << 20) for i in range(10)}
    _ro(m)
    try:
        m.mount()
        for n, d in files.items():
            (m.mnt / n).write_bytes(d)
        _kill(m)
    finally:
        _unro(m)
    m.cache_size = "8M"
    m.extra = ("--block-size", "128K") if False else ()
    _remount(m)
    m.sync()
    for n, d in files.items():
        assert (m.back / n).read_bytes() == d
    m.umount()
    m.cache_size = "8M"


def test_sigkill_during_the_replay_recovers_again(make_mount, tmp_path):
    from faultfs import Shim
    m = make_mount(mount=False)
    src = tmp_path / "src"
    src.mkdir()
    shim = Shim(src, m.back, tmp_path / "ctl")
    try:
        shim.set("eio create write rename mknod")
        m.mount()
        (m.mnt / "f").write_bytes(b"data")     # acknowledged; pending (backing fails)
        time.sleep(0.5)                         # RELEASE: the publish record (seq 1) is written
        _kill(m)
        shim.set("hang readdir")
        p = subprocess.Popen([sys.executable, "-m", "acpfs", *m.args()], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        pid = None
        while pid is None:
            assert time.time() < deadline
            time.sleep(0.2)
            for line in m.log.read_text().splitlines():
                if "recovering: a previous daemon" in line:
                    pid = int(re.search(r"acpfs\[(\d+)\]", line).group(1))
        time.sleep(1.5)                         # stuck listing the backing, mid-recovery
        os.kill(pid, signal.SIGKILL)
        try:
            p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        shim.set("ok")
        time.sleep(0.3)
        _remount(m)
        m.sync()
        assert (src / "f").read_bytes() == b"data"
    finally:
        m.cleanup()
        shim.close()
