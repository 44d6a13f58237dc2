"""mount(8) and fstab (docs/operations.md).

The mount helper (acpfs/mounthelper.py) is run by a real ``mount -t fuse.acpfs`` and a real
``mount -a`` of a temporary fstab; ``/sbin/mount.fuse.acpfs`` points at this checkout's
helper for the test and is put back as it was after. Needs root (mount(8) runs helpers only
for root)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import is_mounted, wait_for

from acpfs import mounthelper

ROOT = Path(__file__).resolve().parent.parent
HELPER_LINK = Path("/sbin/mount.fuse.acpfs")   # /usr/sbin with usrmerge: libmount looks in /sbin

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount(8) runs helpers for root only")


@pytest.fixture
def mount_helper(tmp_path):
    """mount(8) finds this checkout's helper, run by this interpreter, while the test runs;
    what was at HELPER_LINK before is put back."""
    wrapper = tmp_path / "mount.fuse.acpfs"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(ROOT))} "
                       f"exec {shlex.quote(sys.executable)} -m acpfs.mounthelper \"$@\"\n")
    wrapper.chmod(0o755)
    saved = HELPER_LINK.with_name(HELPER_LINK.name + f".saved-{os.getpid()}")
    had = os.path.lexists(HELPER_LINK)
    if had:
        os.rename(HELPER_LINK, saved)
    try:
        os.symlink(wrapper, HELPER_LINK)
        yield HELPER_LINK
    finally:
        if os.path.lexists(HELPER_LINK):
            os.unlink(HELPER_LINK)
        if had:
            os.rename(saved, HELPER_LINK)


def options(m, *more: str) -> str:
    """The ``-o`` list that places a test mount's cache and log as conftest's Mount does."""
    return ",".join([f"cache_size={m.cache_size}", f"cache_dir={m.cache_dir}",
                     f"log_file={m.log}", "log_level=debug", *more])


def mount_t(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=120)


def test_each_option_of_acpfs_mount_has_its_mount_option():
    """The map is read from ``acpfs mount``'s parser: every option but --backing (the
    source) and --foreground (mount(8) waits for the helper) has an underscore name."""
    help_text = subprocess.run([sys.executable, "-m", "acpfs", "mount", "--help"],
                               capture_output=True, text=True, check=True).stdout
    long_options = {w.strip("[],").split("=")[0] for w in help_text.split() if w.startswith("--")}
    long_options -= {"--help", "--backing", "--foreground"}
    assert len(long_options) >= 18
    for opt in sorted(long_options):
        name = opt[2:].replace("-", "_")
        action = mounthelper.mount_actions()[name]
        if action.nargs == 0:
            assert mounthelper.translate([name], sloppy=False) == ([opt], []), name
        else:
            value = str(action.choices[0]) if action.choices else "1"
            assert mounthelper.translate([f"{name}={value}"], sloppy=False) == ([opt, value], [])


def test_mount_t_fuse_acpfs_maps_options_and_ignores_mounts_own(make_mount, mount_helper):
    m = make_mount(mount=False, cache_size="64M")
    r = mount_t("-t", "fuse.acpfs", str(m.back), str(m.mnt), "-o", options(
        m, "fsync=backing", "flush_workers=2", "noexec", "_netdev", "nofail", "noatime",
        "x-systemd.requires=network-online.target", "defaults", "nosuid", "nodev"))
    assert r.returncode == 0, r.stderr
    assert is_mounted(m.mnt)                      # live when mount(8) returns
    st = m.status()
    m.pid = st["pid"]
    assert (st["backing"], st["cache_dir"], st["log_file"]) == (str(m.back), str(m.cache_dir),
                                                                 str(m.log))
    assert st["options"]["fsync"] == "backing" and st["options"]["flush_workers"] == 2
    assert st["cache"]["limit_bytes"] == 64 << 20
    with open("/proc/self/mounts") as f:
        line = next(x.split() for x in f if x.split()[1] == str(m.mnt))
    assert line[2] == "fuse.acpfs" and {"noexec", "nosuid", "nodev", "rw"} <= set(line[3].split(","))
    (m.mnt / "f").write_bytes(b"through mount -t")
    m.sync("f")
    assert (m.back / "f").read_bytes() == b"through mount -t"
    m.umount()
    assert not is_mounted(m.mnt)


def test_fstab_line_mounts_with_mount_all_and_plain_umount_drains(make_mount, mount_helper,
                                                                   tmp_path):
    m = make_mount(mount=False, cache_size="64M")
    fstab = tmp_path / "fstab"
    fstab.write_text("# acpfs over a backing, as in /etc/fstab\n"
                     f"{m.back} {m.mnt} fuse.acpfs "
                     f"{options(m, '_netdev', 'nofail', 'x-systemd.mount-timeout=5min')} 0 0\n")
    for _ in range(2):                            # the second finds it mounted: nothing to do
        r = mount_t("-a", "-T", str(fstab), "-t", "fuse.acpfs")
        assert r.returncode == 0, r.stderr
        assert is_mounted(m.mnt)
    m.pid = m.status()["pid"]
    data = os.urandom(8 << 20)
    (m.mnt / "ckpt.bin").write_bytes(data)
    r = subprocess.run(["umount", str(m.mnt)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: not os.path.exists(f"/proc/{m.pid}"), 60, "the daemon to drain and exit")
    assert (m.back / "ckpt.bin").read_bytes() == data
    assert "all changes persisted" in m.log.read_text()
    r = mount_t("-T", str(fstab), str(m.mnt))     # by its mount point, as 'mount /ckpt' does
    assert r.returncode == 0, r.stderr
    assert (m.mnt / "ckpt.bin").read_bytes() == data
    m.umount()


BAD = [   # (-o option, what the one line must name)
    ("bogus", "'bogus'"),
    ("cache_size=lots", "'lots'"),            # checked by acpfs mount itself
    ("fsync=never", "fsync=never"),
    ("flush_workers=many", "flush_workers=many"),
    ("allow_other=1", "'allow_other'"),
    ("cache_size", "'cache_size'"),
    ("ro", "'ro'"),
    ("dirsync", "'dirsync'"),
    ("sync", "'sync'"),
    ("backing=/elsewhere", "'backing'"),
    ("foreground", "'foreground'"),
]


def test_mount_helper_refuses_a_bad_option_in_one_line_and_mounts_nothing(make_mount,
                                                                         mount_helper):
    m = make_mount(mount=False, cache_size="64M")
    for bad, named in BAD:
        r = mount_t("-t", "fuse.acpfs", str(m.back), str(m.mnt), "-o", options(m, bad))
        assert r.returncode == 1, (bad, r.returncode, r.stderr)   # mount(8): bad invocation
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("acpfs: ") and named in lines[0], (bad, lines)
        assert "Traceback" not in r.stderr
        assert not is_mounted(m.mnt) and not m.cache_dir.exists(), bad
    r = mount_t("-t", "fuse.acpfs", str(m.back / "missing"), str(m.mnt), "-o", options(m))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "missing" in r.stderr and not is_mounted(m.mnt)
    # -f (fake): checked and said, not mounted; -s (sloppy): unknown options only warned of
    r = mount_t("-f", "-s", "-t", "fuse.acpfs", str(m.back), str(m.mnt), "-o", options(m, "bogus"))
    assert r.returncode == 0, r.stderr
    assert "ignoring unknown mount options (-s): bogus" in r.stderr
    assert f"acpfs mount {m.mnt} --backing {m.back} --cache-size 64M" in r.stderr
    assert not is_mounted(m.mnt) and not m.cache_dir.exists()


def test_plain_umount_returns_before_the_data_is_in_the_backing(make_mount, faults,
                                                                mount_helper, tmp_path):
    """What docs/operations.md says of umount(8) and of stopping a .mount unit: the kernel
    lets go at once; the daemon persists the rest afterwards, waited for by nobody."""
    m = make_mount(mount=False, cache_size="64M")
    src = tmp_path / "slow-src"
    shim = faults.shim(src, m.back)
    r = mount_t("-t", "fuse.acpfs", str(m.back), str(m.mnt), "-o", options(m))
    assert r.returncode == 0, r.stderr
    faults.mounts.append(m)
    m.pid = m.status()["pid"]
    os.listdir(m.mnt)
    shim.stop()                                   # the backing stops answering
    (m.mnt / "unsaved").write_bytes(b"not yet in the backing")
    start = time.monotonic()
    r = subprocess.run(["umount", str(m.mnt)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - start < 10
    assert not is_mounted(m.mnt)
    assert os.path.exists(f"/proc/{m.pid}") and not (src / "unsaved").exists()
    shim.cont()
    wait_for(lambda: not os.path.exists(f"/proc/{m.pid}"), 60, "the daemon to drain and exit")
    assert (src / "unsaved").read_bytes() == b"not yet in the backing"
