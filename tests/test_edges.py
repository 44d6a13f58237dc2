"""Edge cases found in review: write-through files, readers of replaced files, shutdown with
open files, special files and reserved names."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest

from conftest import is_mounted, wait_gone


def test_path_truncate_of_a_file_larger_than_the_cache_is_persisted(make_mount):
    m = make_mount(mount=False, cache_size="8M")
    data = os.urandom(40 << 20)
    (m.back / "big").write_bytes(data)
    m.mount()
    os.truncate(m.mnt / "big", 10 << 20)          # no open handle, larger than half the cache
    assert (m.mnt / "big").read_bytes() == data[:10 << 20]
    m.sync()
    assert (m.back / "big").read_bytes() == data[:10 << 20]
    os.truncate(m.mnt / "big", 0)
    (m.mnt / "after").write_bytes(b"after")
    m.sync()
    assert (m.back / "big").read_bytes() == b"" and (m.back / "after").read_bytes() == b"after"


def test_truncate_to_zero_while_a_written_through_file_is_published(make_mount):
    m = make_mount(cache_size="8M")
    with open(m.mnt / "big", "wb") as f:
        for _ in range(40):
            f.write(os.urandom(1 << 20))
    os.truncate(m.mnt / "big", 0)
    with open(m.mnt / "big", "ab") as f:
        f.write(b"after")
    m.sync()
    assert (m.back / "big").read_bytes() == b"after"


def test_written_through_file_moved_out_of_a_removed_directory(make_mount):
    m = make_mount(cache_size="8M")
    (m.mnt / "D").mkdir()
    data = os.urandom(30 << 20)
    with open(m.mnt / "D" / "big", "wb") as f:
        f.write(data)
        os.rename(m.mnt / "D" / "big", m.mnt / "big")
        os.rmdir(m.mnt / "D")
    m.sync()
    assert (m.back / "big").read_bytes() == data
    assert not (m.back / "D").exists()


def test_special_files_in_the_backing_are_shown_and_removable(make_mount):
    m = make_mount(mount=False)
    (m.back / "D").mkdir()
    os.mkfifo(m.back / "D" / "pipe")
    m.mount()
    assert os.listdir(m.mnt / "D") == ["pipe"]
    with pytest.raises(OSError) as e:
        os.rmdir(m.mnt / "D")
    assert e.value.errno == errno.ENOTEMPTY
    os.unlink(m.mnt / "D" / "pipe")
    os.rmdir(m.mnt / "D")
    m.sync()
    assert not (m.back / "D").exists()


def test_reserved_names_are_refused(mnt):
    for name in (".acpfs-tmp-notes", ".acpfs-tmp-spill"):
        with pytest.raises(OSError) as e:
            (mnt.mnt / name).write_bytes(b"x")
        assert e.value.errno == errno.EPERM
    (mnt.mnt / "ok").write_bytes(b"x")
    with pytest.raises(OSError) as e:
        os.rename(mnt.mnt / "ok", mnt.mnt / ".acpfs-tmp-1-2")
    assert e.value.errno == errno.EPERM


def test_reader_keeps_the_version_it_opened(make_mount):
    m = make_mount(mount=False, cache_size="4M")
    (m.back / "latest").write_bytes(b"old content")
    m.mount()
    reader = open(m.mnt / "latest", "rb", buffering=0)   # uncached: served from the backing
    try:
        (m.mnt / "latest.tmp").write_bytes(b"NEW!content")
        os.rename(m.mnt / "latest.tmp", m.mnt / "latest")
        m.sync()
        assert reader.read() == b"old content"
    finally:
        reader.close()
    assert (m.mnt / "latest").read_bytes() == b"NEW!content"


def test_sigterm_persists_files_still_open_for_writing(make_mount):
    m = make_mount()
    f = open(m.mnt / "open.log", "wb")
    f.write(b"line 1\n" * 10000)
    f.flush()
    os.kill(m.pid, signal.SIGTERM)
    wait_gone(m.pid, 60)
    try:
        f.close()
    except OSError:
        pass   # the mount is gone; the data written before SIGTERM must be in the backing
    assert not is_mounted(m.mnt)
    assert (m.back / "open.log").read_bytes() == b"line 1\n" * 10000
    assert "still open for writing" in m.log.read_text()
