"""mount(8), fstab and the install for every user (docs/operations.md).

The mount helper (acpfs/mounthelper.py) is run by a real ``mount -t fuse.acpfs`` and a real
``mount -a`` of a temporary fstab; ``/sbin/mount.fuse.acpfs`` points at this checkout's
helper for the test and is put back as it was after. The system install
(``tools/setup --system``) goes to a temporary prefix, with its links in temporary
directories, and a user other than root mounts, writes, syncs and unmounts with it. Needs
root (mount(8) runs helpers only for root, useradd, runuser)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import gone, is_mounted, wait_for

from acpfs.commands import mounthelper

ROOT = Path(__file__).resolve().parent.parent
HELPER_LINK = Path("/sbin/mount.fuse.acpfs")   # /usr/sbin with usrmerge: libmount looks in /sbin
USER = "acpfs-test"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount(8) runs helpers for root only")


@pytest.fixture
def mount_helper(tmp_path):
    """mount(8) finds this checkout's helper, run by this interpreter, while the test runs;
    what was at HELPER_LINK before is put back."""
    wrapper = tmp_path / "mount.fuse.acpfs"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(ROOT))} "
                       f"exec {shlex.quote(sys.executable)} -m acpfs.commands.mounthelper \"$@\"\n")
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
    long_options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", help_text))
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
    r = mount_t("-a", "-T", str(fstab), "-t", "fuse.acpfs")     # as at boot
    assert r.returncode == 0, r.stderr
    assert is_mounted(m.mnt)
    m.pid = m.status()["pid"]
    r = mount_t("-a", "-T", str(fstab), "-t", "fuse.acpfs")     # mounted already: no-op
    assert r.returncode == 0, r.stderr
    assert m.status()["pid"] == m.pid
    data = os.urandom(8 << 20)
    (m.mnt / "ckpt.bin").write_bytes(data)
    r = subprocess.run(["umount", str(m.mnt)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: gone(m.pid), 60, "the daemon to drain and exit")
    assert (m.back / "ckpt.bin").read_bytes() == data
    assert "all changes persisted" in m.log.read_text()
    r = mount_t("-T", str(fstab), str(m.mnt))     # by its mount point, as 'mount /ckpt' does
    assert r.returncode == 0, r.stderr
    m.pid = m.status()["pid"]
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
    assert not gone(m.pid) and not (src / "unsaved").exists()
    shim.cont()
    wait_for(lambda: gone(m.pid), 60, "the daemon to drain and exit")
    assert (src / "unsaved").read_bytes() == b"not yet in the backing"


# -- the install for every user ------------------------------------------------------------
def other_user(name: str = USER) -> pwd.struct_passwd:
    """A user other than root, made if absent (kept: it holds nothing)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        name], check=True, capture_output=True)
        return pwd.getpwnam(name)


def as_user(user: pwd.struct_passwd, home: Path, *cmd: str, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` as ``user`` in a clean environment: no ACPFS_* variable of the suite's (a
    non-root mount takes the daemon's path: passthrough needs root)."""
    env = ["env", "-i", f"HOME={home}", "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"]
    r = subprocess.run(["runuser", "-u", user.pw_name, "--", *env, *cmd], capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} as {user.pw_name} failed ({r.returncode}): {r.stderr}")
    return r


def outside_checkout() -> dict[str, str]:
    """The environment without what would make a Python run this checkout's acpfs."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def system_setup(prefix: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([str(ROOT / "tools" / "setup"), "--system", "--prefix", str(prefix),
                        "--bindir", str(prefix / "links" / "bin"),
                        "--sbindir", str(prefix / "links" / "sbin")],
                       capture_output=True, text=True, timeout=600, env=outside_checkout())
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture
def fuse_for_users():
    """/dev/fuse open to every user (mode 0666, as udev sets it) while the test runs: a
    container may leave it 0600, and libfuse opens it as the user who mounts. Put back."""
    mode = os.stat("/dev/fuse").st_mode & 0o777
    os.chmod("/dev/fuse", mode | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


def test_system_install_serves_a_user_other_than_root(fuse_for_users):
    user = other_user()
    system_link = os.readlink("/usr/local/bin/acpfs") if os.path.islink("/usr/local/bin/acpfs") \
        else None
    prefix = Path(tempfile.mkdtemp(prefix="acpfs-install-", dir="/tmp"))
    home = Path(tempfile.mkdtemp(prefix="acpfs-user-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="acpfs-user-", dir="/dev/shm"))
    mnt, back = home / "ckpt", home / "back"
    try:
        prefix.chmod(0o755)
        for d in (home, shm):
            os.chown(d, user.pw_uid, user.pw_gid)
        for _ in range(2):                        # idempotent: the second run updates in place
            system_setup(prefix)
        venv = prefix / "venv"
        acpfs_bin = prefix / "links" / "bin" / "acpfs"
        assert os.readlink(acpfs_bin) == str(venv / "bin" / "acpfs")
        assert os.readlink(prefix / "links" / "sbin" / "mount.fuse.acpfs") == \
            str(venv / "bin" / "mount.fuse.acpfs")
        where = subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import acpfs, acpfs.fuse._fastwrite; print(acpfs.__file__)"],
                               capture_output=True, text=True, check=True, cwd="/",
                               env=outside_checkout()).stdout
        assert where.startswith(str(venv)), where   # a copy, not the checkout
        # its mount helper, as mount(8) would run it (-f: checked, not mounted)
        r = subprocess.run([str(prefix / "links" / "sbin" / "mount.fuse.acpfs"), "-f", str(back),
                            str(mnt), "-o", "cache_size=64M,_netdev"],
                           capture_output=True, text=True, timeout=60, env=outside_checkout())
        assert r.returncode == 0 and "--cache-size 64M" in r.stderr, r.stderr

        as_user(user, home, "mkdir", str(mnt), str(back))
        as_user(user, home, str(acpfs_bin), "mount", str(mnt), "--backing", str(back),
                "--cache-size", "64M", "--cache-dir", str(shm / "cache"),
                "--log-file", str(home / "acpfs.log"))
        try:
            st = json.loads(as_user(user, home, str(acpfs_bin), "status", str(mnt), "--json").stdout)
            assert st["passthrough"]["on"] is False
            # --idle-poll auto: the latency device is root's alone; the mount serves anyway
            assert st["idle_poll"] == {"on": False, "why_not": "cannot open /dev/cpu_dma_latency "
                                       "(Permission denied; only root may)"}, st["idle_poll"]
            assert Path(st["cache_dir"]) == shm / "cache"
            as_user(user, home, "sh", "-c", f"head -c 3000000 /dev/urandom > {mnt}/model.pt && "
                    f"echo model.pt > {mnt}/latest")
            as_user(user, home, str(acpfs_bin), "sync", str(mnt), "--timeout", "60")
            assert (back / "latest").read_text() == "model.pt\n"
            assert (back / "model.pt").stat().st_size == 3000000
            assert (back / "model.pt").stat().st_uid == user.pw_uid
        finally:
            r = as_user(user, home, str(acpfs_bin), "umount", str(mnt), "--timeout", "60",
                        check=False)
            if is_mounted(mnt):
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        assert r.returncode == 0, r.stderr
        assert not is_mounted(mnt)
    finally:
        for d in (prefix, home, shm):
            shutil.rmtree(d, ignore_errors=True)
    now = os.readlink("/usr/local/bin/acpfs") if os.path.islink("/usr/local/bin/acpfs") else None
    assert now == system_link, "the install went to its own links, not /usr/local/bin/acpfs"
