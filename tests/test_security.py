"""A shared machine (issue 13): what other users can and cannot do through a mount.

Each test runs the other user's part as a process that drops to ``nobody`` (uid 65534) first,
on a mount with ``--allow-other`` (without it, the kernel lets no other user in at all).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

from conftest import acpfs

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
