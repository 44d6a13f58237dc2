"""``acpfs recover``: what a daemon killed with SIGKILL left in its cache directory is
persisted without mounting, in its order, with the backing mounted meanwhile or not
(docs/operations.md, "Recovering without mounting")."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from conftest import ACPFS, acpfs, read_only, wait_for


def killed_with_pending(m, n: int = 12) -> dict[str, bytes]:
    """Write ``n`` shards and then ``latest`` through ``m`` over a read-only backing (so that
    all of it stays pending), kill the daemon with SIGKILL, detach its stale mount. Returns
    what was written."""
    files = {f"step1/shard{i}": os.urandom(200_000 + i) for i in range(n)}
    with read_only(m.back):
        m.mount()
        (m.mnt / "step1").mkdir()
        for name, data in files.items():
            (m.mnt / name).write_bytes(data)
        (m.mnt / "latest.tmp").write_text("step1")
        os.rename(m.mnt / "latest.tmp", m.mnt / "latest")
        os.kill(m.pid, signal.SIGKILL)
        wait_for(lambda: not os.path.exists(f"/proc/{m.pid}/status")
                 or "zombie" in open(f"/proc/{m.pid}/status").read(), timeout=10)
    subprocess.run(["umount", "-l", str(m.mnt)], capture_output=True)
    return files


def recover(m, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return acpfs("recover", "--backing", str(m.back), "--cache-dir", str(m.cache_dir),
                 "--log-file", str(m.root / "recover.log"), *extra, check=check)


def test_recover_persists_what_a_killed_daemon_left_in_its_order(make_mount):
    m = make_mount(cache_size="64M", mount=False)
    files = killed_with_pending(m)
    assert not (m.back / "latest").exists()
    r = recover(m)
    assert "everything" in r.stderr and "persisted" in r.stderr, r.stderr
    for name, data in files.items():
        assert (m.back / name).read_bytes() == data, name
    assert (m.back / "latest").read_text() == "step1"
    assert not (m.back / "latest.tmp").exists()
    # in the dead daemon's order: the pointer landed after every shard it points to
    last_shard = max((m.back / name).stat().st_ctime_ns for name in files)
    assert (m.back / "latest").stat().st_ctime_ns >= last_shard
    # everything persisted: the cache directory is gone, and a run over the
    # default cache directory, which holds nothing, says so
    assert not m.cache_dir.exists()
    r = acpfs("recover", "--backing", str(m.back))   # its default cache directory: none
    assert "nothing to recover" in r.stderr
    log = (m.root / "recover.log").read_text()
    assert "recovering" in log and "all changes persisted" in log


def test_recover_while_the_backing_is_mounted_on_this_node(make_mount):
    """One mount per backing on a node, but a recovery is no mount: it runs beside the new
    mount of the same backing (its own cache directory), and that mount sees the result."""
    m = make_mount(cache_size="64M", mount=False)
    files = killed_with_pending(m, n=4)
    other = make_mount("other", cache_size="64M", mount=False)
    other.back.rmdir()
    other.back = m.back            # the same backing, a cache directory of its own
    other.mount()
    try:
        recover(m)
        for name, data in files.items():
            assert (m.back / name).read_bytes() == data
        # the live mount of the backing sees what the recovery persisted
        wait_for(lambda: os.path.exists(other.mnt / "latest"), timeout=30)
        assert (other.mnt / "latest").read_text() == "step1"
        assert (other.mnt / "step1" / "shard3").read_bytes() == files["step1/shard3"]
    finally:
        acpfs("umount", str(other.mnt), check=False)


def test_recover_refuses_bad_input_in_one_line(make_mount, tmp_path):
    m = make_mount(cache_size="64M")
    (m.mnt / "f").write_bytes(b"x")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        # the cache directory of a live daemon: never replayed beside it
        (["--backing", str(m.back), "--cache-dir", str(m.cache_dir)], "in use by a live acpfs daemon"),
        (["--backing", str(tmp_path / "nowhere")], "does not exist"),
        (["--backing", str(m.back), "--cache-dir", ""], "--cache-dir is empty"),
        (["--backing", str(m.back), "--cache-dir", str(m.back)], "hold one another"),
        (["--backing", str(m.back), "--cache-dir", str(tmp_path / "c")], "does not exist"),
        (["--backing", str(m.back), "--cache-dir", str(tmp_path), "--peer-lease", "x"], "not a number"),
        (["--backing", str(m.back), "--cache-dir", str(empty), "--peer-heartbeat", "100"],
         "--peer-heartbeat must be between"),
    ]
    for args, said in cases:
        r = acpfs("recover", *args, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and said in r.stderr, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and lines[-1].startswith("acpfs: "), (args, r.stderr)
    # the live mount lost nothing
    m.sync()
    assert (m.back / "f").read_bytes() == b"x"


def test_recover_stopped_keeps_the_rest_for_the_next_run(make_mount, faults, tmp_path):
    """Ctrl-C while the backing hangs: exit 1 in one line, the cache directory keeps what
    is not persisted, and the next run persists it."""
    m = make_mount(cache_size="64M", mount=False)
    files = killed_with_pending(m, n=3)
    view = tmp_path / "view"
    view.mkdir()
    shim = faults.shim(m.back, view)    # the same backing, through a view that can hang
    shim.set("hang write")
    p = subprocess.Popen(ACPFS + ["recover", "--backing", str(view), "--cache-dir", str(m.cache_dir),
                                  "--log-file", str(m.root / "recover.log")],
                         stderr=subprocess.PIPE, text=True)
    wait_for(lambda: shim.counts().get("write", 0) > 0, timeout=60)
    p.send_signal(signal.SIGINT)
    log = m.root / "recover.log"
    wait_for(lambda: "got SIGINT during the drain" in log.read_text(), timeout=60)
    time.sleep(1.0)   # the drain's loop looks every 0.2 s, then stops the flusher for good
    # the upload that hangs in the backing holds the process until the backing answers, as
    # a hard NFS mount would; answered now, it ends, and nothing more is applied
    shim.set("ok")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert "stopped before everything was persisted" in err and "Traceback" not in err, err
    assert "exiting with changes NOT persisted" in log.read_text()
    assert not (m.back / "latest").exists()
    assert (m.cache_dir / "journal").exists()
    recover(m)
    for name, data in files.items():
        assert (m.back / name).read_bytes() == data
    assert (m.back / "latest").read_text() == "step1"
