"""Attributes answered below Python (acpfs/fuse/attrtable.py, acpfs/fuse/_attrs.c; docs/design.md,
"GETATTR answered in C").

The kernel asks for a file's attributes again after each change; the C extension answers
those GETATTRs from what the daemon last answered, while that holds, and GETXATTRs of names
outside ``user.`` with ENODATA. These tests check both halves of the promise on a real
mount: the requests are answered there (``status``: ``answered_in_c``, and Python's own
request counts stay flat), and every change, made through the mount or by another node,
shows in the next ``stat`` exactly as without the table (random changes against a plain
directory; the model tests, tests/test_model.py, compare sizes, modes and links after every
step too).
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import stat
import time

import pytest

from conftest import Mount

# long enough that no answer runs out while a test looks (the kernel's own cache: 5 s)
TIMEOUT = ("--coherence-timeout", "30")


def counts(m: Mount) -> tuple[dict, dict]:
    st = m.status()
    return st["requests"], st["answered_in_c"]


def test_stat_after_a_close_and_security_xattrs_are_answered_below_python(make_mount):
    """50 files written and closed, each stat'ed right after: the stats after the first
    reach Python at most once each for the directory, never for the files; the kernel's
    security.capability question before each first write is answered ENODATA in C."""
    m = make_mount(extra=TIMEOUT)
    (m.mnt / "d").mkdir()
    first, _ = counts(m)
    before, c0 = counts(m)
    assert c0["on"], c0
    per_status = before.get("getxattr", 0) - first.get("getxattr", 0)   # its own xattr reads
    for i in range(50):
        p = m.mnt / "d" / f"f{i}"
        with open(p, "wb") as f:
            f.write(b"x" * (i + 1))
        st = os.stat(p)
        assert st.st_size == i + 1 and stat.S_ISREG(st.st_mode)
    after, c1 = counts(m)
    python_getattrs = after.get("getattr", 0) - before.get("getattr", 0)
    assert python_getattrs <= 5, f"{python_getattrs} GETATTRs of 50 files reached Python"
    assert c1["getattr_answered"] - c0["getattr_answered"] >= 50
    # the writes asked Python for no xattr: only status() itself did (user.acpfs.status)
    assert after.get("getxattr", 0) - before.get("getxattr", 0) == per_status
    with pytest.raises(OSError) as e:
        os.getxattr(m.mnt / "d" / "f0", "security.capability")
    assert e.value.errno == errno.ENODATA
    with pytest.raises(OSError) as e:
        os.getxattr(m.mnt / "d" / "f0", "trusted.x")
    assert e.value.errno == errno.ENODATA
    os.setxattr(m.mnt / "d" / "f0", "user.k", b"v")
    assert os.getxattr(m.mnt / "d" / "f0", "user.k") == b"v"


def shown(st: os.stat_result) -> tuple:
    """What a change must show: kind and mode, size, links (directories: their count too)."""
    return (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, st.st_nlink)


def step(rng: random.Random, root, names: list[str]) -> str:
    """One random change under ``root`` (the mount's or the reference's; the same choices
    on both when ``rng`` is seeded alike). Returns what it did, for the message."""
    a, b = rng.choice(names), rng.choice(names)
    pa, pb = os.path.join(root, a), os.path.join(root, b)
    what = rng.choice(["write", "append", "truncate", "chmod", "link", "unlink", "rename",
                       "mkdir", "rmdir", "utime", "xattr", "held", "mapped"])
    n = rng.randrange(0, 70000)
    try:
        if what == "write":
            with open(pa, "wb") as f:
                f.write(b"w" * n)
        elif what == "append":
            with open(pa, "ab") as f:
                f.write(b"a" * (n % 5000))
        elif what == "truncate":
            os.truncate(pa, n)
        elif what == "chmod":
            os.chmod(pa, rng.choice([0o600, 0o644, 0o755]))
        elif what == "link":
            os.link(pa, pb)
        elif what == "unlink":
            os.unlink(pa)
        elif what == "rename":
            os.rename(pa, pb)
        elif what == "mkdir":
            os.mkdir(os.path.join(root, "sub", a))
        elif what == "rmdir":
            os.rmdir(os.path.join(root, "sub", a))
        elif what == "utime":
            os.utime(pa, ns=(n * 10**9, n * 10**9))
        elif what == "xattr":
            os.setxattr(pa, "user.k", b"v" * (n % 10))
        elif what == "held":   # a writer kept open: stat between its writes
            fd = os.open(pa, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                for k in range(3):
                    os.pwrite(fd, b"h" * 100, n + k * 1000)
                    os.fstat(fd)
            finally:
                os.close(fd)
        elif what == "mapped":   # a shared mapping written after the close
            fd = os.open(pa, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size) if size else None
            finally:
                os.close(fd)
            if mm is not None:
                mm[0:1] = b"M"
                mm.close()
        return f"{what} {a} {b} {n}: ok"
    except OSError as e:
        return f"{what} {a} {b} {n}: {errno.errorcode[e.errno]}"


@pytest.mark.parametrize("seed", [1, 2])
def test_every_change_shows_in_the_next_stat_as_on_a_plain_directory(make_mount, tmp_path, seed):
    """300 random changes (writes, appends, truncates, chmod, links, unlinks, renames,
    mkdir/rmdir, utimens, xattrs, a writer held open, a mapping written after its close),
    each done on the mount and on a plain directory: the same outcome, and after each every
    name's stat shows the same mode, size and link count (utimens: the same mtime), while
    the table answers many of those stats (the kernel answers most of the rest itself)."""
    m = make_mount(extra=TIMEOUT)
    ref = tmp_path / "ref"
    ref.mkdir()
    names = ["a", "b", "c", "d"]
    for root in (m.mnt, ref):
        os.mkdir(os.path.join(root, "sub"))
        for name in names[:2]:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"0" * 10)
    _, c0 = counts(m)
    r_mnt, r_ref = random.Random(seed), random.Random(seed)
    for i in range(300):
        got, want = step(r_mnt, m.mnt, names), step(r_ref, ref, names)
        assert got == want, f"step {i}: mount {got}, reference {want}"
        for name in names + ["sub", "."] + [f"sub/{n}" for n in names]:
            pm, pr = os.path.join(m.mnt, name), os.path.join(ref, name)
            try:
                sr = os.lstat(pr)
            except FileNotFoundError:
                assert not os.path.lexists(pm), f"step {i} ({got}): {name} exists on the mount"
                continue
            sm = os.lstat(pm)
            assert shown(sm) == shown(sr), f"step {i} ({got}): {name}: {shown(sm)} != {shown(sr)}"
            if got.startswith("utime") and got.endswith("ok") and name == got.split()[1]:
                assert sm.st_mtime_ns == sr.st_mtime_ns, f"step {i} ({got}): mtime"
    _, c1 = counts(m)
    assert c1["getattr_answered"] - c0["getattr_answered"] > 100, c1   # (about half of them)
    for name in names:
        pm, pr = m.mnt / name, ref / name
        if pr.is_file():
            assert pm.read_bytes() == pr.read_bytes(), name


def test_another_nodes_version_shows_once_the_coherence_timeout_ran_out(make_nodes):
    """A node's stat answered from the table never outlives the coherence check: B grows a
    file A has stat'ed many times (answers held in C); after B's sync, A's stat shows the new
    size within the coherence timeout (1 s) plus the check, and A's open at once."""
    a, b = make_nodes(2, extra=("--coherence-timeout", "1"))
    a.path("f").write_bytes(b"1" * 100)
    a.sync()
    for _ in range(20):
        assert os.stat(a.path("f")).st_size == 100
        with open(a.path("f"), "rb") as f:
            f.read(1)
    assert a.status()["answered_in_c"]["getattr_answered"] > 0
    with open(b.path("f"), "ab") as f:
        f.write(b"2" * 900)
    b.sync()
    synced = time.monotonic()
    with open(a.path("f"), "rb") as f:
        assert len(f.read()) == 1000, "the open did not look at the backing"
    while os.stat(a.path("f")).st_size != 1000:
        assert time.monotonic() - synced < 1 + 5 + 2, "A's stat kept the old size"
        time.sleep(0.05)


def test_a_writer_passed_through_is_answered_from_its_memory_file(make_mount):
    """The kernel writes a passed-through writer's memory file without telling the daemon;
    its fstat after each write is answered in C from that memory file: the size of every
    write, a time set by utimens kept until the next write, and no GETATTR for Python."""
    m = make_mount(extra=TIMEOUT)
    if not m.status()["passthrough"]["on"]:
        pytest.skip("the daemon's path: every write reaches the daemon")
    p = m.mnt / "w.bin"
    p.write_bytes(b"x" * 4096)   # a known size: the next writer is passed through
    before, c0 = counts(m)
    opens = m.status()["passthrough"]["opens"]
    fd = os.open(p, os.O_WRONLY)   # (read-write, a file this small would keep the page cache)
    try:
        assert m.status()["passthrough"]["opens"] == opens + 1, "the writer was not passed through"
        for i in range(100):
            os.pwrite(fd, b"y" * 10, 4096 + i * 1000)
            assert os.fstat(fd).st_size == 4096 + i * 1000 + 10
        os.utime(fd, ns=(10**18, 10**18))
        assert os.fstat(fd).st_mtime_ns == 10**18
        assert os.fstat(fd).st_mtime_ns == 10**18
        os.pwrite(fd, b"z", 0)
        assert os.fstat(fd).st_mtime_ns != 10**18
        os.ftruncate(fd, 50)
        assert os.fstat(fd).st_size == 50
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 50
    after, c1 = counts(m)
    python_getattrs = after.get("getattr", 0) - before.get("getattr", 0)
    assert python_getattrs <= 10, f"{python_getattrs} of 100 fstats reached Python"
    assert c1["getattr_answered"] - c0["getattr_answered"] >= 100


def test_files_not_persisted_keep_their_answers_until_they_land(make_mount, faults, tmp_path):
    """docs/semantics.md, section 10: the kernel keeps the entry and attributes of a regular
    file with a change of this mount pending until the change lands; then the coherence
    timeout holds again. The backing is a faultfs mirror whose renames hang, so no publish
    lands while the test looks: 30 files written, then stat'ed and 10 of them unlinked more
    than the coherence timeout (1 s) later, cost no LOOKUP and no GETATTR in Python. Once
    they land (and files removed before their publish once the removal does), the kernel is
    told to drop them: another program's new version of one of them
    in the backing shows in a stat within the coherence timeout, as for any file."""
    m = make_mount(extra=("--coherence-timeout", "1"), mount=False)
    shim = faults.shim(tmp_path / "src", m.back)
    faults.mount(m)
    d = m.mnt / "d"
    d.mkdir()
    names = [f"f{i}" for i in range(30)]
    shim.set("hang rename")
    try:
        for i, n in enumerate(names):
            (d / n).write_bytes(b"x" * (100 + i))
        time.sleep(1.5)   # the kernel timeout of every other answer ran out
        r0, _ = counts(m)
        for i, n in enumerate(names):
            assert os.stat(d / n).st_size == 100 + i
        for n in names[:10]:
            os.unlink(d / n)
        st = m.status()
        r1 = st["requests"]
        for i in range(5):   # removed before their publish: let go once the removal lands
            (d / f"eph{i}").write_bytes(b"e")
            os.unlink(d / f"eph{i}")
        assert st["queue"]["applied_seq"] < st["queue"]["last_seq"], "the shim held nothing"
        held = st["kernel_held"]
        assert held["on"] and held["files"] >= 20, held
        # the directory's own entry ran out (a directory is never held): one LOOKUP, maybe two
        assert r1.get("lookup", 0) - r0.get("lookup", 0) <= 2, (r0, r1)
        assert r1.get("getattr", 0) - r0.get("getattr", 0) <= 2, (r0, r1)
        assert r1.get("unlink", 0) - r0.get("unlink", 0) == 10
    finally:
        shim.set("ok")
    m.sync()
    deadline = time.monotonic() + 5
    while m.status()["kernel_held"]["files"]:
        assert time.monotonic() < deadline, m.status()["kernel_held"]
        time.sleep(0.05)
    assert m.status()["kernel_held"]["released"] >= 35
    assert os.stat(d / "f10").st_size == 110
    (m.back / "d" / "f10").write_bytes(b"y" * 5000)   # another program, in the backing
    changed = time.monotonic()
    while os.stat(d / "f10").st_size != 5000:
        assert time.monotonic() - changed < 1 + 2, "the kernel kept a held answer after it landed"
        time.sleep(0.05)
    assert sorted(os.listdir(d)) == sorted(names[10:])
