"""A cache directory on a disk filesystem (a node's local NVMe): the content store lives in
files there, the kernel's page cache bounds the RAM they hold and `--cache-size` the disk
(docs/semantics.md, section 6). `acpfs mount` and `status` say which kind of store a mount
has and what bounds its RAM, and a daemon killed with SIGKILL loses nothing acknowledged:
the next mount recovers from the files on the disk."""

from __future__ import annotations

import mmap
import os
import resource
import signal
import threading
import time

import pytest

from acpfs import mounttable
from acpfs.config import ram_filesystem

from conftest import acpfs, gone, read_only, wait_for


@pytest.fixture
def disk_area(tmp_path):
    """A directory on a disk filesystem for the cache directory (tmp_path, where it is on one)."""
    area = tmp_path / "local-disk"
    area.mkdir()
    if ram_filesystem(str(area)):
        pytest.skip(f"{area} is on {ram_filesystem(str(area))}: no disk filesystem to test on here")
    return str(area)


def test_the_mount_says_its_store_is_on_disk_and_the_page_cache_bounds_its_ram(make_mount,
                                                                               disk_area):
    m = make_mount(cache_size="64M", cache_area=disk_area, mount=False)
    said = acpfs(*m.args()).stderr
    m.pid = m.status()["pid"]
    fs = mounttable.fstype_of(disk_area)
    cache = m.status()["cache"]
    assert cache["filesystem"] == fs and cache["ram_bounded_by"] == "page cache", cache
    line = next(line for line in said.splitlines() if line.startswith("acpfs: content store: "))
    assert f"{cache['store']} on {fs} in {m.cache_dir}" in line, line
    assert "disk bounded by --cache-size (64.0 MiB)" in line and "page cache" in line, line
    assert f"{cache['store']} on {fs}: RAM bounded by the page cache" in acpfs("status", str(m.mnt)).stdout
    assert str(m.cache_dir).startswith(disk_area)
    data = {f"rank{i}.pt": os.urandom(24 << 20) for i in range(4)}     # 96 MiB through 64 MiB
    threads = [threading.Thread(target=(m.mnt / name).write_bytes, args=(blob,))
               for name, blob in data.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.sync()
    for name, blob in data.items():
        assert (m.back / name).read_bytes() == blob
        assert (m.mnt / name).read_bytes() == blob
    assert m.store_bytes() > 0, "what the mount caches is in the cache directory on the disk"

def test_a_tmpfs_store_says_ram_is_bounded_by_the_cache_size(make_mount):
    m = make_mount(cache_size="64M", mount=False)
    said = acpfs(*m.args()).stderr
    m.pid = m.status()["pid"]
    cache = m.status()["cache"]
    assert cache["filesystem"] == "tmpfs" and cache["ram_bounded_by"] == "cache size", cache
    assert f"content store: {cache['store']} on tmpfs in {m.cache_dir}: RAM bounded by " \
           f"--cache-size (64.0 MiB)" in said, said


def test_a_daemon_killed_with_a_disk_store_is_recovered_from_it(make_mount, disk_area):
    m = make_mount(cache_size="64M", cache_area=disk_area, mount=False)
    files = {f"f{i}": os.urandom(300_000 + i) for i in range(12)}
    with read_only(m.back):         # a backing that refuses writes keeps everything pending
        m.mount()
        for name, data in files.items():
            (m.mnt / name).write_bytes(data)
        (m.mnt / "latest").write_text("f11")
        assert m.status()["dirty"]["files"] + m.status()["flushing"]["files"] == 13
        os.kill(m.pid, signal.SIGKILL)
        time.sleep(0.2)
    r = acpfs(*m.args())
    assert "stale mount" in r.stderr
    m.pid = m.status()["pid"]
    rec = m.status()["recovery"]
    assert rec["files"] == 13, rec
    assert m.status()["cache"]["filesystem"] == mounttable.fstype_of(disk_area)
    m.sync()
    for name, data in files.items():
        assert (m.back / name).read_bytes() == data
    assert (m.back / "latest").read_text() == "f11"


def test_a_tmpfs_cache_directory_gets_huge_pages_of_its_own_until_everything_is_persisted(
        make_mount):
    """acpfs/daemon/hugecache.py: an empty cache directory on tmpfs without huge pages gets a
    tmpfs of its own with huge=within_size (a mapped 64 MiB cached file then faults a few
    dozen times, not once per 64 KiB); a daemon killed leaves it, files and all, for the
    next daemon; a clean unmount takes it away; ACPFS_NO_HUGE_PAGES=1 and a directory that
    holds files leave the directory as it is."""
    m = make_mount(cache_size="256M")
    cache = m.status()["cache"]
    assert cache["huge_pages"] == "on", cache
    own = mounttable.mount_at(str(m.cache_dir))
    assert own is not None and own.fstype == "tmpfs" and own.source == "acpfs-cache", own
    assert "huge=within_size" in own.options.split(","), own
    assert "huge pages on" in acpfs("status", str(m.mnt)).stdout
    data = os.urandom(1 << 20) * 64
    (m.mnt / "model.bin").write_bytes(data)
    if m.status()["passthrough"]["on"]:   # the mapping is the memory file's own
        with open(m.mnt / "model.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            assert sum(mm[i] for i in range(0, len(data), 4096)) == \
                sum(data[i] for i in range(0, len(data), 4096))
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults <= 64, f"{faults} page faults for a 64 MiB mapping: no huge pages"
    os.kill(m.pid, signal.SIGKILL)
    wait_for(lambda: gone(m.pid), 30, "the daemon gone")
    assert mounttable.mount_at(str(m.cache_dir)) == own, "a killed daemon's tmpfs stays"
    acpfs("umount", str(m.mnt), "--lazy", check=False)
    m.mount()
    assert m.status()["cache"]["huge_pages"] == "on"
    assert (m.mnt / "model.bin").read_bytes() == data
    assert [x.id for x in mounttable.table() if x.mountpoint == str(m.cache_dir)] == [own.id], \
        "the next daemon used the tmpfs it found, and stacked none"
    acpfs("umount", str(m.mnt))
    assert mounttable.mount_at(str(m.cache_dir)) is None and not m.cache_dir.exists()
    assert (m.back / "model.bin").read_bytes() == data

    off = make_mount("off", env={"ACPFS_NO_HUGE_PAGES": "1"})
    assert off.status()["cache"]["huge_pages"] == "off: ACPFS_NO_HUGE_PAGES"
    assert mounttable.mount_at(str(off.cache_dir)) is None
    held = make_mount("held", mount=False)
    held.cache_dir.mkdir(mode=0o700)
    (held.cache_dir / "left-by-someone").write_bytes(b"x")
    held.mount()
    assert held.status()["cache"]["huge_pages"].startswith("off: the cache directory holds files")
    assert mounttable.mount_at(str(held.cache_dir)) is None
    assert (held.cache_dir / "left-by-someone").read_bytes() == b"x"
