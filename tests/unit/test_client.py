"""acpfs.commands.client without a mount: the mount table parsed from mountinfo text (escaped names,
other file systems, nested mounts), the control attributes read through a stand-in
``os.getxattr`` (stale mounts told apart), and the durability wait against a stand-in status
reader (progress, timeout), also as ``acpfs sync`` shows it."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acpfs import mounttable
from acpfs.commands import client, syncing
from acpfs.core import control
from acpfs.errors import Failure

REPO = Path(__file__).resolve().parents[2]


def line(mount_id: int, mountpoint: str, fstype: str, optional: str = "shared:1") -> str:
    """One mountinfo line; ``mountpoint`` is written escaped, as the kernel does."""
    esc = (mountpoint.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
           .replace("\n", "\\012"))
    return (f"{mount_id} 27 0:{mount_id} / {esc} rw,nosuid,nodev,relatime {optional} - "
            f"{fstype} {fstype.split('.')[-1]} rw,user_id=1000,group_id=1000")


# -- the mount table ---------------------------------------------------------------------------
def test_unescape_the_four_escapes_and_nothing_else():
    assert mounttable.unescape("/a\\040b\\011c\\012d\\134e") == "/a b\tc\nd\\e"
    # a backslash followed by digits in the name itself is written \134 + the digits
    assert mounttable.unescape("/x\\134040") == "/x\\040"
    assert mounttable.unescape("/x\\134\\040y") == "/x\\ y"
    assert mounttable.unescape("/plain/ünïcode#1") == "/plain/ünïcode#1"


def test_parse_mountinfo_keeps_every_mount_with_its_id_and_type():
    text = "\n".join([
        "22 27 0:21 / /proc rw,relatime - proc proc rw",
        line(40, "/mnt/ckpt", "fuse.acpfs"),
        line(41, "/mnt/with space", "fuse.acpfs", optional=""),       # no optional field
        line(42, "/mnt/tab\there", "fuse.acpfs", optional="shared:7 master:3"),
        line(43, "/mnt/new\nline", "fuse.acpfs"),
        line(44, "/mnt/back\\slash", "fuse.acpfs"),
        line(45, "/mnt/other", "fuse.sshfs"),
        "garbage without a separator",
        "",
    ])
    got = mounttable.parse_mountinfo(text)
    fuse = "rw,user_id=1000,group_id=1000"
    assert got == [
        mounttable.Mount("22", "/proc", "proc", "0:21", "proc", "rw"),
        mounttable.Mount("40", "/mnt/ckpt", "fuse.acpfs", "0:40", "acpfs", fuse),
        mounttable.Mount("41", "/mnt/with space", "fuse.acpfs", "0:41", "acpfs", fuse),
        mounttable.Mount("42", "/mnt/tab\there", "fuse.acpfs", "0:42", "acpfs", fuse),
        mounttable.Mount("43", "/mnt/new\nline", "fuse.acpfs", "0:43", "acpfs", fuse),
        mounttable.Mount("44", "/mnt/back\\slash", "fuse.acpfs", "0:44", "acpfs", fuse),
        mounttable.Mount("45", "/mnt/other", "fuse.sshfs", "0:45", "sshfs", fuse),
    ]
    assert mounttable.acpfs_mounts(text) == ["/mnt/ckpt", "/mnt/with space", "/mnt/tab\there",
                                         "/mnt/new\nline", "/mnt/back\\slash"]


def test_mount_ids_and_type_follow_the_top_mount():
    # mounted, lost its daemon, mounted again on top: the later line is the visible mount
    text = "\n".join([line(60, "/mnt/c", "fuse.acpfs"), line(61, "/mnt/c", "fuse.acpfs"),
                      line(62, "/mnt/d", "tmpfs"), line(63, "/mnt/d", "fuse.acpfs"),
                      line(64, "/mnt/e", "fuse.acpfs"), line(65, "/mnt/e", "ext4")])
    assert mounttable.acpfs_mount_ids(text) == {"/mnt/c": "61", "/mnt/d": "63", "/mnt/e": "64"}
    assert mounttable.mount_type("/mnt/c", text) == "fuse.acpfs"
    assert mounttable.mount_type("/mnt/e", text) == "ext4"
    assert mounttable.mount_type("/mnt/c/sub", text) is None
    assert mounttable.mount_type("/nowhere", text) is None


def test_this_process_mount_table_is_read_when_no_text_is_given():
    mine = mounttable.table()
    assert any(m.mountpoint == "/" for m in mine)
    assert mounttable.acpfs_mounts() == [m.mountpoint for m in mine if m.fstype == mounttable.FSTYPE]


def test_mount_of_is_the_longest_acpfs_mount_holding_the_path(tmp_path):
    root = os.path.realpath(tmp_path)
    outer, inner, sibling = f"{root}/a b", f"{root}/a b/in\tner", f"{root}/a bc"
    text = "\n".join([line(70, outer, "fuse.acpfs"), line(71, inner, "fuse.acpfs"),
                      line(72, f"{root}/a b/plain", "tmpfs"), line(73, sibling, "fuse.acpfs")])
    assert mounttable.mount_of(f"{outer}/x/y.pt", text) == outer
    assert mounttable.mount_of(outer, text) == outer
    assert mounttable.mount_of(f"{inner}/deep/f", text) == inner
    assert mounttable.mount_of(inner, text) == inner
    assert mounttable.mount_of(f"{outer}/plain/f", text) == outer   # a non-acpfs mount inside one
    assert mounttable.mount_of(f"{sibling}/f", text) == sibling     # "/a bc" is not under "/a b"
    assert mounttable.mount_of(f"{outer}/x/../../a bc/f", text) == sibling
    with pytest.raises(client.Failure, match="is not on an acpfs mount") as e:
        mounttable.mount_of(f"{root}/elsewhere", text)
    assert e.value.errno is None
    # symbolic links are resolved first
    (tmp_path / "link").symlink_to(inner)
    assert mounttable.mount_of(str(tmp_path / "link" / "f"), text) == inner


# -- the control attributes --------------------------------------------------------------------
@pytest.fixture
def xattrs(monkeypatch):
    """A stand-in os.getxattr: (path, name) -> bytes or an errno; every call is recorded."""
    table: dict[tuple[str, bytes], bytes | int] = {}
    calls: list[tuple[str, bytes]] = []

    def getxattr(path: str, name: bytes) -> bytes:
        calls.append((path, name))
        v = table.get((path, name), errno.ENODATA)
        if isinstance(v, int):
            raise OSError(v, os.strerror(v), path)
        return v
    monkeypatch.setattr(client.os, "getxattr", getxattr)
    return table, calls


def test_a_backing_is_local_only_on_a_local_filesystem_with_nothing_mounted_below(tmp_path):
    """--backing-calls auto asks the backing on the event loop only where no call can wait
    for a server: the filesystem holding it is local and no mount (NFS, FUSE, even a local
    one) lies anywhere below it."""
    root = os.path.realpath(tmp_path)
    base = [line(1, "/", "ext4"), line(2, f"{root}/nfs", "nfs4"), line(3, f"{root}/ram", "tmpfs"),
            line(4, f"{root}/ram/fuse", "fuse.faultfs"), line(5, f"{root}/data", "xfs")]
    text = "\n".join(base)
    assert mounttable.local_fstype(f"{root}/data/ckpt", text) == "xfs"
    assert mounttable.local_fstype(f"{root}/nfs/ckpt", text) is None
    assert mounttable.local_fstype(f"{root}/ram/fuse/x", text) is None
    assert mounttable.local_fstype(f"{root}/ram", text) is None          # FUSE mounted below
    assert mounttable.local_fstype(f"{root}/ram/other", text) == "tmpfs"
    assert mounttable.local_fstype(root, text) is None                   # mounts below it
    assert mounttable.local_fstype(f"{root}/else", text) == "ext4"
    assert mounttable.local_fstype(f"{root}/nfsx", text) == "ext4"      # "/nfsx" is not under "/nfs"
    over = "\n".join(base + [line(6, f"{root}/data", "cifs")])          # mounted over it later
    assert mounttable.local_fstype(f"{root}/data/ckpt", over) is None


def test_the_attribute_names_are_controls():
    assert [control.STATE, control.SEQ, control.STATUS, control.FILES, control.PRELOAD] == [
        control.PREFIX + n for n in (b"state", b"seq", b"status", b"files", b"preload")]


def test_read_status_tells_a_stale_mount_from_another_error(xattrs):
    table, calls = xattrs
    table["/m", control.STATUS] = json.dumps({"queue": {"applied_seq": 3}}).encode()
    assert client.read_status("/m") == {"queue": {"applied_seq": 3}}
    assert not client.is_stale("/m")
    for code in (errno.ENOTCONN, errno.ECONNABORTED):
        table["/m", control.STATUS] = code
        with pytest.raises(client.StaleMount) as e:
            client.read_status("/m")
        assert str(e.value) == ("the acpfs daemon of /m is gone (stale mount); "
                                "run 'acpfs umount /m' to clean it up")
        assert e.value.errno == code
        assert client.is_stale("/m")
    table["/m", control.STATUS] = errno.EIO
    with pytest.raises(client.Failure) as e:
        client.read_status("/m")
    assert not isinstance(e.value, client.StaleMount)
    assert str(e.value) == "cannot read the status of /m: Input/output error"
    assert (e.value.errno, e.value.strerror) == (errno.EIO, "Input/output error")
    assert not client.is_stale("/m")
    assert not client.is_stale("/not-acpfs")          # ENODATA
    assert {name for _, name in calls} == {control.STATUS}


def test_the_progress_is_read_from_its_own_attribute_or_an_older_daemons_status(xattrs):
    table, calls = xattrs
    table["/m", control.PROGRESS] = b'{"queue": {"applied_seq": 3}}'
    table["/m", control.STATUS] = b'{"queue": {"applied_seq": 2}, "uptime_s": 1}'
    assert client.read_progress("/m") == {"queue": {"applied_seq": 3}}
    assert calls == [("/m", control.PROGRESS)]
    del table["/m", control.PROGRESS]                  # a daemon before it: ENODATA
    assert client.read_progress("/m") == {"queue": {"applied_seq": 2}, "uptime_s": 1}
    assert calls[1:] == [("/m", control.PROGRESS), ("/m", control.STATUS)]
    table["/m", control.PROGRESS] = errno.ENOTCONN     # a dead daemon is not asked twice
    with pytest.raises(client.StaleMount):
        client.read_progress("/m")
    assert calls[-1] == ("/m", control.PROGRESS)
    table["/m", control.PROGRESS] = errno.EIO
    with pytest.raises(client.Failure, match="^cannot read the progress of /m: Input/output error$"):
        client.read_progress("/m")


def test_is_stale_on_a_real_directory(tmp_path):
    assert client.is_stale(str(tmp_path)) is False
    assert client.is_stale(str(tmp_path / "missing")) is False


def test_read_seq_asks_the_directory_of_a_symlink(xattrs, tmp_path):
    table, calls = xattrs
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "l").symlink_to("f")
    table[str(tmp_path / "f"), control.SEQ] = b'{"seq": 12, "open_dirty": 0}'
    table[str(tmp_path), control.SEQ] = b'{"seq": 15, "open_dirty": 2}'
    assert client.read_seq(str(tmp_path / "f")) == (12, 0)
    assert client.read_seq(str(tmp_path / "l")) == (15, 2)
    assert calls[-1] == (str(tmp_path), control.SEQ)
    table[str(tmp_path / "f"), control.SEQ] = errno.ENOTCONN
    with pytest.raises(client.StaleMount) as e:
        client.read_seq(str(tmp_path / "f"))
    assert e.value.strerror == os.strerror(errno.ENOTCONN)


def test_read_files_and_preload(xattrs):
    table, calls = xattrs
    doc = {"files": [{"path": "a", "state": "dirty", "size": 1}], "total": 1, "truncated": False}
    table["/m", control.FILES] = json.dumps(doc).encode()
    assert client.read_files("/m") == doc
    table["/m/ok", control.PRELOAD] = b'{"size": 1, "cached": true}'
    table["/m/big", control.PRELOAD] = errno.ENOSPC
    table["/m/bad", control.PRELOAD] = errno.EIO
    assert client.preload_file("/m/ok") is True
    assert client.preload_file("/m/big") is False
    with pytest.raises(client.Failure, match=r"^cannot preload /m/bad: Input/output error$"):
        client.preload_file("/m/bad")


# -- waiting for durability ----------------------------------------------------------------------
def status(applied: int, errors: list | None = None) -> dict:
    return {"queue": {"applied_seq": applied, "last_seq": 10}, "errors": errors or [],
            "flushing": {"bytes": 2048}, "flush_rate_bytes_per_s": 1 << 20}


@pytest.fixture
def statuses(monkeypatch):
    """read_progress answers from a list (its last entry once the list is used up)."""
    answers: list[dict | Exception] = []
    asked: list[str] = []

    def read_progress(mountpoint: str) -> dict:
        asked.append(mountpoint)
        a = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(a, Exception):
            raise a
        return a
    monkeypatch.setattr(client, "read_progress", read_progress)
    return answers, asked


def test_wait_applied_returns_once_the_seq_is_applied_and_reports_progress(statuses):
    answers, asked = statuses
    answers[:] = [status(2), status(4), status(6), status(7)]
    seen: list[int] = []
    client.wait_applied("/m", 6, progress=lambda st: seen.append(st["queue"]["applied_seq"]))
    assert seen == [2, 4]            # every status read before seq 6 was applied, not after
    assert asked == ["/m"] * 3
    answers[:] = [status(9)]
    client.wait_applied("/m", 6, timeout=0, progress=lambda st: pytest.fail("already durable"))


def test_wait_applied_times_out_with_the_last_status(statuses):
    answers, asked = statuses
    err = {"path": "a.pt", "op": "publish", "reason": "EIO", "attempts": 3}
    answers[:] = [status(1), status(2, [err])]
    seen = []
    with pytest.raises(client.WaitTimeout) as e:
        client.wait_applied("/m", 5, timeout=0.15, progress=seen.append)
    assert isinstance(e.value, client.Failure)
    assert e.value.status == status(2, [err])
    assert str(e.value) == "/m: sequence number 5 not persisted after 0.15s"
    assert len(seen) == len(asked) >= 3 and seen[-1] is e.value.status
    # timeout 0: one status read, then give up
    asked.clear()
    with pytest.raises(client.WaitTimeout):
        client.wait_applied("/m", 5, timeout=0)
    assert asked == ["/m"]


def test_wait_applied_passes_a_stale_mount_on(statuses):
    answers, _ = statuses
    answers[:] = [status(1), client.StaleMount("gone")]
    with pytest.raises(client.StaleMount, match="gone"):
        client.wait_applied("/m", 5, timeout=10)


def test_acpfs_sync_shows_progress_and_names_the_error_on_timeout(statuses, monkeypatch):
    answers, _ = statuses
    out = io.StringIO()   # not a TTY: a plain line, at most every 5 seconds
    progress = syncing.Progress
    monkeypatch.setattr(syncing, "Progress", lambda: progress(out))
    err = {"path": "run/a.pt", "op": "publish", "reason": "Input/output error", "attempts": 3}
    answers[:] = [status(4), status(7, [err])]
    with pytest.raises(Failure) as e:
        syncing.wait_durable("/m", 10, 0.1, "sync /m")
    assert str(e.value) == ("sync /m: timed out after 0.1s with 3 operations not yet persisted "
                            "(run/a.pt: Input/output error)")
    assert out.getvalue() == ("sync /m: [........................]   0% 6 operations left, "
                              "2.0 KiB queued, 1.0 MiB/s\n")
    answers[:] = [status(4), status(7), status(10)]
    syncing.wait_durable("/m", 10, None, "sync /m")


def test_importing_the_client_loads_nothing_heavy():
    code = ("import sys, acpfs.commands.client, acpfs.commands.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'pyfuse3', 'torch', 'trio') or m == 'acpfs.fuse._fastwrite'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       check=True)
    assert r.stdout.strip() == "[]"


def test_sync_all_nodes_believes_only_records_listed_after_the_call():
    """A record seen before the call says nothing of what its node acknowledged since (an
    idle node's frontier runs ahead of its clock): it counts once a listing after the call
    shows it. A node that left counts at once; an expired one is not waited for."""
    called = 1000.0

    def peer(node, state, frontier, listed):
        return {"node": node, "instance": node * 3, "state": state, "frontier": frontier,
                "listed": listed, "frontier_lag": 0.0, "last_heartbeat": 1.0}
    seen_before = {"listed_at": 999.0, "error": None,
                   "peers": [peer("b", "idle", 1002.0, 999.0)]}
    others = syncing.Others(seen_before, called)
    assert not others.finished()
    assert others.progress("sync --all-nodes /m", called) == \
        "sync --all-nodes /m: waiting for a listing of the node records"
    listed = {"listed_at": 1000.5, "error": None,
              "peers": [peer("b", "up", 999.5, 1000.5), peer("c", "left", 1.0, 1000.5),
                        peer("d", "expired", 10.0, 1000.5), peer("e", "idle", 1002.0, 1000.5)]}
    others = syncing.Others(listed, called)
    assert not others.finished() and [p["node"] for p in others.waiting] == ["b"]
    assert [p["node"] for p in others.lost] == ["d"]
    assert others.progress("sync --all-nodes /m", called) == (
        "sync --all-nodes /m: waiting for node b (daemon bbb, up, 0.5s behind the call); "
        "2 of 4 other nodes done")
    listed["peers"][0] = peer("b", "up", 1000.1, 1000.6)
    assert syncing.Others(listed, called).finished()
