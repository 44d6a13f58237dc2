"""A shared machine (contract 9): what other users can and cannot do through a mount.

Each test runs the other user's part as a process that drops to ``nobody`` (uid 65534) first,
on a mount with ``--allow-other`` (without it, the kernel lets no other user in at all).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import acpfs, is_mounted

NOBODY = 65534


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    prog = "import os, sys\nos.setgid(65534); os.setgroups([]); os.setuid(65534)\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True,
                          timeout=60)


def shared_mount(make_mount):
    m = make_mount(mount=False, extra=("--allow-other",))
    for d in [m.mnt, *m.mnt.parents]:             # let the other user reach the mount point
        if d == d.parent or str(d) == "/tmp":
            break
        os.chmod(d, os.stat(d).st_mode | 0o001)
    m.mount()
    pub = m.mnt / "pub"
    pub.mkdir()
    os.chmod(pub, 0o1777)
    return m, pub


def test_a_write_or_truncate_by_another_user_clears_setuid_and_setgid(make_mount):
    """(point 1) As ext4 does: root's 6777 file appended to by another user becomes 0777, in
    the mount and in the backing; a setgid file without group execute (a locking mark) keeps
    its setgid; root's own writes keep both."""
    m, pub = shared_mount(make_mount)
    for name, mode in (("suid", 0o6777), ("truncated", 0o6777), ("lockmark", 0o2666),
                       ("mine", 0o6777)):
        (pub / name).write_bytes(b"#!/bin/sh\n")
        os.chmod(pub / name, mode)
    r = as_nobody("""
        for name in ("suid", "lockmark"):
            with open(os.path.join(sys.argv[1], name), "ab") as f:
                f.write(b"echo appended by another user\\n")
        os.truncate(os.path.join(sys.argv[1], "truncated"), 5)
    """, str(pub))
    assert r.returncode == 0, r.stderr
    with open(pub / "mine", "ab") as f:            # root: CAP_FSETID, the bits stay
        f.write(b"echo root\n")
    assert stat.S_IMODE(os.stat(pub / "suid").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(pub / "truncated").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(pub / "lockmark").st_mode) == 0o2666
    assert stat.S_IMODE(os.stat(pub / "mine").st_mode) == 0o6777
    m.sync()
    back = m.back / "pub"
    assert stat.S_IMODE(os.stat(back / "suid").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(back / "truncated").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(back / "lockmark").st_mode) == 0o2666
    assert stat.S_IMODE(os.stat(back / "mine").st_mode) == 0o6777
    assert (back / "truncated").read_bytes() == b"#!/bi"
    assert (back / "suid").read_bytes() == b"#!/bin/sh\necho appended by another user\n"
    # a change of owner clears them too, also by root
    os.chmod(pub / "mine", 0o6755)
    os.chown(pub / "mine", NOBODY, -1)
    assert stat.S_IMODE(os.stat(pub / "mine").st_mode) == 0o755


def test_other_users_get_no_file_names(make_mount):
    """(point 2) Another user reads the status document but no file names: the pending list
    is refused, paths in the status are left out; root and the mount's owner still see them."""
    m, pub = shared_mount(make_mount)
    private = m.mnt / "private"
    private.mkdir(mode=0o700)
    with open(private / "secret-name", "wb") as f:
        f.write(b"pending")
        f.flush()
        assert "secret-name" in acpfs("status", str(m.mnt), "--files").stdout
        r = as_nobody("""
            try:
                os.getxattr(sys.argv[1], "user.acpfs.files")
                print("files: read")
            except OSError as e:
                print("files:", e.errno)
            print("status:", os.getxattr(sys.argv[1], "user.acpfs.status").decode())
        """, str(m.mnt))
    assert r.returncode == 0, r.stderr
    assert "files: 13" in r.stdout                # EACCES
    assert "secret-name" not in r.stdout
    doc = json.loads(r.stdout.split("status: ", 1)[1])
    assert doc["dirty"]["files"] == 1             # the counts are there


# -- a second user's own mounts (points 3 and 4) ---------------------------------------------
VICTIM = "acpfs-victim"

# Runs a command as another user in a private mount namespace where that user can reach
# /dev/fuse (a copy of the node, mode 0666, as distributions ship it; this machine's is 0600)
# and this interpreter (under /root here). The namespace dies with the command, and with it
# any mount the command left.
AS_USER = r"""
set -e
aux=$1; user=$2; top=$3; shift 3
mount --bind "$aux/fuse" /dev/fuse
if [ -n "$top" ]; then
    mkdir -p "$aux/top"
    mount --bind "/root/$top" "$aux/top"
    mount -t tmpfs -o mode=755 tmpfs /root
    mkdir "/root/$top"
    mount --bind "$aux/top" "/root/$top"
fi
exec setpriv --reuid "$user" --regid "$user" --clear-groups "$@"
"""


class User:
    """A second unprivileged user, with a home directory of its own under /tmp."""

    def __init__(self, name: str, aux: Path) -> None:
        self.name = name
        self.uid = int(subprocess.check_output(["id", "-u", name]))
        self.aux = aux
        self.home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
        os.chown(self.home, self.uid, self.uid)

    def path(self, name: str, mkdir: bool = False) -> Path:
        p = self.home / name
        if mkdir:
            p.mkdir(mode=0o700)
            os.chown(p, self.uid, self.uid)
        return p

    def run(self, *cmd: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        exe = os.path.realpath(sys.executable)
        top = exe.split("/")[2] if exe.startswith("/root/") else ""
        e = {"PATH": os.environ["PATH"], "HOME": str(self.home), "LANG": "C.UTF-8", **(env or {})}
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", AS_USER,
                               "sh", str(self.aux), self.name, top, "env", "-i",
                               *(f"{k}={v}" for k, v in e.items()), *cmd],
                              capture_output=True, text=True, timeout=timeout)

    def acpfs(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-m", "acpfs", *args, env=env)


@pytest.fixture
def victim(tmp_path):
    if subprocess.run(["id", "-u", VICTIM], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", VICTIM], check=True)
    aux = Path(tempfile.mkdtemp(prefix="acpfs-aux-", dir="/tmp"))
    os.chmod(aux, 0o755)
    os.mknod(aux / "fuse", 0o666 | stat.S_IFCHR, os.makedev(10, 229))
    os.chmod(aux / "fuse", 0o666)
    u = User(VICTIM, aux)
    squatted = [Path(f"/tmp/acpfs-{u.uid}"), Path(f"/dev/shm/acpfs-{u.uid}")]
    for p in squatted:
        shutil.rmtree(p, ignore_errors=True)
    yield u
    for p in (*squatted, u.home, aux):
        shutil.rmtree(p, ignore_errors=True)


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_a_runtime_directory_made_by_another_user_is_refused(victim):
    """(point 3) Another user makes /tmp/acpfs-UID of the victim first, with a lock name
    linked to a file of the victim's and a forged mount record naming the attacker's
    directory as the backing. The victim's mount is refused with one line, the file is
    untouched, and acpfs.torch does not believe the record: a save goes where it was told,
    not into the attacker's directory. With XDG_RUNTIME_DIR (a directory of its own) the
    victim mounts, and its record lands there."""
    from acpfs.config import key_of
    mnt, back = victim.path("ckpt", mkdir=True), victim.path("back", mkdir=True)
    precious = victim.path("precious")
    precious.write_text("keep me\n")
    os.chown(precious, victim.uid, victim.uid)
    run = f"/tmp/acpfs-{victim.uid}"
    loot = tempfile.mkdtemp(prefix="acpfs-loot-", dir="/tmp")
    os.chown(loot, NOBODY, NOBODY)
    try:
        r = as_nobody("""
            run, precious, loot, km, kb = sys.argv[1:6]
            os.mkdir(run); os.chmod(run, 0o777)
            for name in (f"mount-{km}.lock", f"backing-{kb}.lock"):
                os.symlink(precious, os.path.join(run, name))
            with open(os.path.join(run, f"mount-{km}.json"), "w") as f:
                f.write('{"mountpoint": "%s", "backing": "%s"}' % (sys.argv[6], loot))
        """, run, str(precious), loot, key_of(str(mnt)), key_of(str(back)), str(mnt))
        assert r.returncode == 0, r.stderr
        r = victim.acpfs("mount", str(mnt), "--backing", str(back), "--cache-size", "64M")
        assert r.returncode == 1
        assert f"runtime directory {run} belongs to user nobody" in one_line(r)
        assert precious.read_text() == "keep me\n"
        r = victim.run(sys.executable, "-c", textwrap.dedent("""
            import sys, torch, acpfs.torch
            saved = acpfs.torch.save({"w": torch.ones(3)}, sys.argv[1] + "/model.pt")
            print(saved.route, saved.written)
        """), str(mnt))
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[0] == "plain" and os.listdir(loot) == []
        assert (mnt / "model.pt").stat().st_uid == victim.uid
        os.unlink(mnt / "model.pt")
        # its own runtime directory: XDG_RUNTIME_DIR
        xdg = victim.path("xdg", mkdir=True)
        r = victim.run("sh", "-c", f"""
            set -e
            {sys.executable} -m acpfs mount {mnt} --backing {back} --cache-size 64M
            echo data > {mnt}/file
            {sys.executable} -m acpfs sync {mnt}
            ls {xdg}/acpfs
            {sys.executable} -m acpfs umount {mnt}
        """, env={"XDG_RUNTIME_DIR": str(xdg)})
        assert r.returncode == 0, r.stderr
        assert f"mount-{key_of(str(mnt))}.json" in r.stdout.split()
        assert (back / "file").read_text() == "data\n"
        assert sorted(os.listdir(run)) == sorted([f"mount-{key_of(str(mnt))}.lock",
                                                  f"backing-{key_of(str(back))}.lock",
                                                  f"mount-{key_of(str(mnt))}.json"])
    finally:
        shutil.rmtree(loot, ignore_errors=True)


def test_a_cache_directory_reached_through_another_users_link_or_directory_is_refused(make_mount, victim):
    """(point 4) Root's mount given a --cache-dir that is another user's symbolic link, or
    lies in another user's directory or in a directory others may change, is refused with
    one line, and the directory the link names is left as it was (it was made 0700 and
    filled with the pool and journal). The default cache directory of a user, made first by
    another user in /dev/shm, is refused too."""
    m = make_mount(mount=False)
    target = Path(tempfile.mkdtemp(prefix="acpfs-target-", dir="/tmp"))
    os.chmod(target, 0o755)
    evil = Path(tempfile.mkdtemp(prefix="acpfs-evil-", dir="/tmp"))
    os.chown(evil, NOBODY, NOBODY)
    shared = Path(tempfile.mkdtemp(prefix="acpfs-shared-", dir="/tmp"))
    os.chmod(shared, 0o777)                       # writable by all, not sticky
    try:
        link = Path(f"{evil}-link")               # in /tmp itself, which is sticky
        r = as_nobody("os.symlink(sys.argv[1], sys.argv[2])", str(target), str(link))
        assert r.returncode == 0, r.stderr
        base = m.args()
        i = base.index("--cache-dir")
        for cache, why in ((link, "is a symbolic link"),
                           (link / "cache", f"through the symbolic link {link} of user nobody"),
                           (evil / "sub", f"lies in {evil}, which belongs to user nobody"),
                           (shared / "cache", f"lies in {shared}, which other users can change")):
            r = acpfs(*base[:i], "--cache-dir", str(cache), *base[i + 2:], check=False)
            assert r.returncode == 1 and why in one_line(r), (cache, r.stderr)
            assert not is_mounted(m.mnt)
        assert stat.S_IMODE(target.stat().st_mode) == 0o755 and os.listdir(target) == []
        assert not (evil / "sub").exists() or (evil / "sub").stat().st_uid == 0
        # a user's default cache directory, made first by another user
        r = as_nobody("os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)",
                      f"/dev/shm/acpfs-{victim.uid}")
        assert r.returncode == 0, r.stderr
        mnt, back = victim.path("ckpt", mkdir=True), victim.path("back", mkdir=True)
        xdg = victim.path("xdg", mkdir=True)
        r = victim.acpfs("mount", str(mnt), "--backing", str(back), "--cache-size", "64M",
                         env={"XDG_RUNTIME_DIR": str(xdg)})
        assert r.returncode == 1
        assert f"lies in /dev/shm/acpfs-{victim.uid}, which belongs to user nobody" in one_line(r)
    finally:
        for d in (target, evil, shared):
            shutil.rmtree(d, ignore_errors=True)
        Path(f"{evil}-link").unlink(missing_ok=True)


def test_a_node_record_planted_by_another_user_holds_nobody(make_mount):
    """Records planted by another user are ignored: the node records directory of a backing is
    1777 (every user's mounts keep records there). Another user plants records in it: one of a
    node that does not exist, with changes pending since the epoch and a heartbeat in 2100 (it
    would hold every change for ever, and never expire), and one that forges this node's own
    instance. The daemon ignores both, with a WARNING naming each file and its owner, and `acpfs
    sync` does not wait for them (it waited for the lease, 30 s, before)."""
    m = make_mount(mount=False)
    for d in [m.back, *m.back.parents]:           # let the other user reach the backing
        if d == d.parent or str(d) == "/tmp":
            break
        os.chmod(d, os.stat(d).st_mode | 0o001)
    m.mount()
    records = m.back / ".acpfs-nodes"
    assert stat.S_IMODE(records.stat().st_mode) == 0o1777
    inst = m.status()["instance"]
    planted = ["0badc0ffee00.1.1.4102444800000000.up.evil:_ckpt",
               f"{inst}.999999.1.4102444800000000.up.forged:_ckpt"]
    r = as_nobody("""
        for name in sys.argv[2:]:
            open(os.path.join(sys.argv[1], name), "x").close()
    """, str(records), *planted)
    assert r.returncode == 0, r.stderr
    assert all((records / n).stat().st_uid == NOBODY for n in planted)
    deadline = time.monotonic() + 20
    while "0badc0ffee00" not in m.log.read_text():     # listed (and ignored, or not)
        assert time.monotonic() < deadline, "the daemon did not list the planted record"
        time.sleep(0.1)
    (m.mnt / "step_1").mkdir()
    (m.mnt / "step_1" / "shard").write_bytes(b"x" * 10000)
    (m.mnt / "latest").write_text("step_1")
    start = time.monotonic()
    r = acpfs("sync", str(m.mnt), "--timeout", "10", check=False)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - start < 10
    assert (m.back / "latest").read_text() == "step_1"
    st = m.status()
    assert st["peers"]["peers"] == [] and st["peers"]["held"] is None
    log = m.log.read_text()
    for name in planted:
        line = next(x for x in log.splitlines() if f"ignoring the node record {name}" in x)
        assert " WARNING " in line and "belongs to user nobody (uid 65534)" in line, line
    assert "longer than the lease" not in log
