"""Temporary files in the backing that nobody else can predict, adopt or stall
(contract 9), on a real mount.

Earlier temporary names were ``.acpfs-tmp-<ino>-<seq>``, counters anyone could guess, and
uploads opened them without ``O_EXCL``. In a world-writable backing directory another user
could create the next names first, keep them open, and read root's private file as it was
uploaded (or write into it), or stall the flusher with a symlink or a directory there.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap

NOBODY = 65534
# The attacker: create files, symlinks and directories under every name the old scheme
# could use for the next uploads, keep the files open, then (when told) report what could
# be read through the descriptors.
ATTACKER = textwrap.dedent("""
    import os, sys
    os.setgid(65534); os.setuid(65534)
    d = sys.argv[1]
    fds = []
    for ino in range(2, 12):
        for seq in range(1, 40):
            name = os.path.join(d, f".acpfs-tmp-{ino}-{seq}")
            kind = (ino + seq) % 3
            if kind == 0:
                os.symlink("/etc/passwd", name)
            elif kind == 1:
                os.mkdir(name)
            else:
                fds.append(os.open(name, os.O_RDWR | os.O_CREAT, 0o666))
    print("ready", len(fds), flush=True)
    sys.stdin.readline()
    seen = b"".join(os.pread(fd, 1 << 16, 0) for fd in fds)
    print("read", seen.count(b"SECRET"), flush=True)
""")


def test_another_user_cannot_adopt_or_stall_temporary_files(make_mount):
    m = make_mount(mount=False)
    for d in [m.back, *m.back.parents]:           # let the other user reach the backing
        if d == d.parent or str(d) == "/tmp":
            break
        os.chmod(d, os.stat(d).st_mode | 0o001)
    pub = m.back / "pub"
    pub.mkdir()
    os.chmod(pub, 0o1777)                         # like /tmp: anyone may create names here
    m.mount()
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(pub)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline().startswith("ready")
        secret = b"SECRET " + os.urandom(16).hex().encode()
        for i in range(5):
            p = m.mnt / "pub" / f"secret{i}"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secret)
            finally:
                os.close(fd)
        (m.mnt / "pub" / "sub").mkdir()
        m.sync(timeout=60)                        # nothing placed in the way stalls the flusher
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        report = attacker.stdout.readline()
        assert report == "read 0\n", f"the attacker read root's private bytes: {report!r}"
    finally:
        attacker.kill()
        attacker.wait()
    for i in range(5):
        st = os.stat(pub / f"secret{i}")
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
        assert (pub / f"secret{i}").read_bytes() == secret
    assert (pub / "sub").is_dir()
    # the daemon's own temporary files are gone; the attacker's stay (never touched)
    inst = m.status()["instance"]
    left = [n for n in os.listdir(pub) if n.startswith(".acpfs-tmp-")]
    assert left and all(re.fullmatch(r"\.acpfs-tmp-\d+-\d+", n) for n in left), left
    assert not any(inst in n for n in os.listdir(pub))
