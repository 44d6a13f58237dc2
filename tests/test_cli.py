"""The command line: mount/status/sync/umount, refusals, idempotence, drains on every exit path."""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ACPFS, acpfs, gone, is_mounted, mounted_soon, wait_gone


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("acpfs: ")
    assert "Traceback" not in r.stderr
    return lines[0]


def test_help_is_complete():
    r = acpfs("--help")
    for cmd in ("mount", "status", "sync", "preload", "temps", "umount", "recover"):
        assert cmd in r.stdout
    r = acpfs("mount", "--help")
    for opt in ("--backing", "--cache-dir", "--cache-size", "--fsync", "--flush-workers", "--log-level",
                "--log-file", "--allow-other", "--foreground", "ACPFS_"):
        assert opt in r.stdout


def test_mount_help_gives_the_defaults_that_config_holds():
    """Each default of ``acpfs mount`` is written once, in acpfs/config.py: the help texts
    print config's values."""
    from acpfs import config
    text = " ".join(acpfs("mount", "--help").stdout.split())   # lines wrapped anywhere
    for opt, shown in [
            ("--flush-workers", f"(default {config.DEFAULT_FLUSH_WORKERS})"),
            ("--cache-full-timeout", f"(default {config.DEFAULT_CACHE_FULL_TIMEOUT:g})"),
            ("--persist-open-after", f"(default {config.DEFAULT_PERSIST_OPEN_AFTER:g};"),
            ("--coherence-timeout", f"(default {config.DEFAULT_COHERENCE_TIMEOUT:g};"),
            ("--global-order", f"(default {config.DEFAULT_GLOBAL_ORDER};"),
            ("--max-clock-skew", f"(default {config.DEFAULT_MAX_CLOCK_SKEW:g})"),
            ("--peer-heartbeat", f"(default {config.DEFAULT_PEER_HEARTBEAT:g})"),
            ("--peer-lease", f"(default {config.DEFAULT_PEER_LEASE:g})"),
            ("--passthrough", f"'{config.DEFAULT_PASSTHROUGH}' (default)"),
            ("--backing-calls", f"'{config.DEFAULT_BACKING_CALLS}' (default)"),
            ("--idle-poll", f"'{config.DEFAULT_IDLE_POLL}' (default)"),
            ("--fsync", f"'{config.DEFAULT_FSYNC}' (default:"),
            ("--block-size", f"(default {config.short_size(config.DEFAULT_BLOCK_SIZE)};"),
            ("--log-level", f"{config.DEFAULT_LOG_LEVEL} (default)"),
            ("--metrics", f"on {config.METRICS_HOST};"),
            ("--cache-size", f"(default {config.DEFAULT_CACHE_FRACTION * 100:g}% of RAM")]:
        help_of_opt = text.split(f" {opt} ", 1)[1].split(" --", 1)[0]
        assert shown in help_of_opt, (opt, help_of_opt)
    assert config.parse_size(config.short_size(config.DEFAULT_BLOCK_SIZE)) == config.DEFAULT_BLOCK_SIZE


def test_mount_options_come_from_the_command_line_then_the_environment_then_config(monkeypatch):
    """What ``acpfs mount`` gives the daemon, without a mount: config's defaults where
    neither the command line nor an ACPFS_* variable names the option; and the defaults
    of ``Options``, the one object the daemon is given, are the same values."""
    import dataclasses

    from acpfs import config
    from acpfs.commands import cli
    from acpfs.core import control
    for name in [n for n in os.environ if n.startswith("ACPFS_")]:
        monkeypatch.delenv(name)
    parse = cli.build_parser().parse_args
    settings = config.settings(parse(["mount", "/mnt", "--backing", "/b"]))
    defaults = dict(fsync_backing=config.DEFAULT_FSYNC == "backing",
                    flush_workers=config.DEFAULT_FLUSH_WORKERS, log_level=config.DEFAULT_LOG_LEVEL,
                    cache_full_timeout=config.DEFAULT_CACHE_FULL_TIMEOUT,
                    persist_open_after=config.DEFAULT_PERSIST_OPEN_AFTER,
                    coherence_timeout=config.DEFAULT_COHERENCE_TIMEOUT,
                    global_order=config.DEFAULT_GLOBAL_ORDER == "on",
                    max_clock_skew=config.DEFAULT_MAX_CLOCK_SKEW,
                    peer_heartbeat=config.DEFAULT_PEER_HEARTBEAT, peer_lease=config.DEFAULT_PEER_LEASE,
                    block_size=config.DEFAULT_BLOCK_SIZE, foreground=False,
                    passthrough=config.DEFAULT_PASSTHROUGH, metrics=config.DEFAULT_METRICS,
                    backing_calls=config.DEFAULT_BACKING_CALLS, idle_poll=config.DEFAULT_IDLE_POLL,
                    peers_listen="", replicas=0, replica_budget=0, replica_wait=False)
    assert settings == defaults
    flags = {"allow_other": False, "noexec": False, "mlock": False}   # read with the places
    for field in dataclasses.fields(config.Options):
        if field.default is not dataclasses.MISSING:
            assert field.default == {**defaults, **flags}[field.name], field.name
    assert all(f.name != "coherence_timeout" for f in dataclasses.fields(control.MountInfo)), \
        "MountInfo keeps runtime facts only: options are read from MountInfo.opts"
    monkeypatch.setenv("ACPFS_PEER_LEASE", "45")
    monkeypatch.setenv("ACPFS_BLOCK_SIZE", "1M")
    monkeypatch.setenv("ACPFS_PASSTHROUGH", "off")
    monkeypatch.setenv("ACPFS_METRICS", ":9710")
    monkeypatch.setenv("ACPFS_BACKING_CALLS", "threads")
    monkeypatch.setenv("ACPFS_IDLE_POLL", "off")
    settings = config.settings(parse(["mount", "/mnt", "--backing", "/b", "--peer-lease", "50"]))
    assert (settings["peer_lease"], settings["block_size"], settings["passthrough"]) == (50, 1 << 20, "off")
    assert settings["metrics"] == ":9710" and settings["backing_calls"] == "threads"
    assert settings["idle_poll"] == "off"
    monkeypatch.setenv("ACPFS_PEERS_LISTEN", "127.0.0.1:0")
    monkeypatch.setenv("ACPFS_REPLICAS", "1")
    monkeypatch.setenv("ACPFS_REPLICA_BUDGET", "2G")
    monkeypatch.setenv("ACPFS_REPLICA_WAIT", "1")
    settings = config.settings(parse(["mount", "/mnt", "--backing", "/b"]))
    assert (settings["replicas"], settings["replica_budget"], settings["replica_wait"]) == \
        (1, 2 << 30, True)
    monkeypatch.delenv("ACPFS_REPLICAS")
    with pytest.raises(config.UsageError, match="--replica-wait needs --replicas 1"):
        config.settings(parse(["mount", "/mnt", "--backing", "/b"]))
    for name in ("ACPFS_PEERS_LISTEN", "ACPFS_REPLICA_BUDGET", "ACPFS_REPLICA_WAIT"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACPFS_IDLE_POLL", "never")
    with pytest.raises(config.UsageError, match="invalid --idle-poll 'never': use auto or off"):
        config.settings(parse(["mount", "/mnt", "--backing", "/b"]))
    monkeypatch.delenv("ACPFS_IDLE_POLL")
    monkeypatch.setenv("ACPFS_PEERS_LISTEN", "10.0.0.7:7070")
    assert config.settings(parse(["mount", "/mnt", "--backing", "/b"]))["peers_listen"] == "10.0.0.7:7070"
    assert config.settings(parse(["mount", "/mnt", "--backing", "/b", "--peers-listen",
                                  "[::1]:0"]))["peers_listen"] == "[::1]:0"
    for bad in ("7070", "host:", "host:port", "host:70000"):
        with pytest.raises(config.UsageError, match=f"invalid --peers-listen '{re.escape(bad)}': use "
                           "HOST:PORT"):
            config.settings(parse(["mount", "/mnt", "--backing", "/b", "--peers-listen", bad]))
    with pytest.raises(config.UsageError, match="--peers-listen needs global order"):
        config.settings(parse(["mount", "/mnt", "--backing", "/b", "--global-order", "off"]))
    monkeypatch.delenv("ACPFS_PEERS_LISTEN")
    monkeypatch.setenv("ACPFS_BACKING_CALLS", "sometimes")
    with pytest.raises(config.UsageError, match="invalid --backing-calls 'sometimes'"):
        config.settings(parse(["mount", "/mnt", "--backing", "/b"]))


@pytest.mark.parametrize("args,needle", [
    (["mount"], "required"),
    (["mount", "/nonexistent-mnt", "--backing", "/tmp"], "does not exist"),
    (["frobnicate"], "invalid choice"),
    (["sync", "/nonexistent-path"], "does not exist"),
    (["sync", "/tmp"], "not on an acpfs mount"),
    (["status", "/tmp"], "not on an acpfs mount"),
    (["umount", "/tmp"], "not an acpfs mount"),
    (["sync", "--timeout", "-1"], "negative"),
    (["temps", "/nonexistent-backing"], "not a directory"),
    (["temps", "/tmp", "--older-than", "soon"], "bad age"),
])
def test_usage_errors_are_one_line(args, needle):
    r = acpfs(*args, check=False)
    assert needle in one_line_error(r)


def test_refused_mounts(make_mount, tmp_path):
    m = make_mount(mount=False)
    base = m.args()
    # missing backing
    r = acpfs("mount", str(m.mnt), "--backing", str(tmp_path / "nope"), check=False)
    assert "does not exist" in one_line_error(r)
    # non-empty mount point
    (m.mnt / "junk").write_text("x")
    r = acpfs(*base, check=False)
    assert "not empty" in one_line_error(r)
    os.unlink(m.mnt / "junk")
    # backing inside the mount point, mount point inside the backing
    (m.mnt / "inner").mkdir()
    r = acpfs("mount", str(m.mnt), "--backing", str(m.mnt / "inner"), check=False)
    assert "inside the mount point" in one_line_error(r)
    os.rmdir(m.mnt / "inner")
    (m.back / "sub").mkdir()
    r = acpfs("mount", str(m.back / "sub"), "--backing", str(m.back), check=False)
    assert "inside the backing" in one_line_error(r)
    # bad sizes and options
    r = acpfs(*base[:-2], "--cache-size", "lots", check=False)
    assert "invalid cache size" in one_line_error(r)
    r = acpfs(*base, "--flush-workers", "0", check=False)
    assert "flush-workers" in one_line_error(r)
    r = acpfs(*base, env={**os.environ, "ACPFS_FSYNC": "sometimes"}, check=False)
    assert "fsync" in one_line_error(r)
    r = acpfs(*base, "--max-clock-skew", "5", check=False)
    assert "--max-clock-skew" in one_line_error(r)
    r = acpfs(*base, "--peer-heartbeat", "1", "--peer-lease", "2", check=False)
    assert "--peer-lease" in one_line_error(r)
    assert not is_mounted(m.mnt)
    # same backing twice
    m.mount()
    other = tmp_path / "other-mnt"
    other.mkdir()
    r = acpfs("mount", str(other), "--backing", str(m.back), "--cache-size", "64M", check=False)
    assert "already mounted" in one_line_error(r)
    assert not is_mounted(other)


def test_backings_in_acpfs_own_places_are_refused_before_anything_is_created(make_mount, tmp_path):
    """Places that overlap are refused: a backing inside acpfs's cache area in /dev/shm (other
    mounts' pools and journals) or holding it, inside the cache directory or holding it, and a
    cache directory inside the mount point, are refused with one line, before a cache directory,
    a pool or a lock file exists."""
    from acpfs.config import default_cache_dir, key_of
    m = make_mount(mount=False)
    area = Path(f"/dev/shm/acpfs-{os.getuid()}")
    made_area = not area.exists()
    area.mkdir(mode=0o700, exist_ok=True)
    in_area = Path(tempfile.mkdtemp(prefix="backing-", dir=area))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "back").mkdir()
    lock = Path("/run/acpfs") / f"mount-{key_of(str(m.mnt))}.lock"
    try:
        for backing, cache_dir, needle in (
                (in_area, None, f"is inside {area}, where acpfs keeps the cache directories"),
                (Path("/dev/shm"), tmp_path / "c2", f"holds {area}, where acpfs keeps"),
                (m.back, m.back / "cache", f"cache directory {m.back}/cache is inside the backing"),
                (cache / "back", cache, f"backing directory {cache}/back is inside the cache "
                                        f"directory {cache}"),
                (m.back, m.back, "is the same directory as the cache directory"),
                (tmp_path / "elsewhere", m.mnt / "cache", "is inside the mount point")):
            backing.mkdir(exist_ok=True)
            args = ["mount", str(m.mnt), "--backing", str(backing), "--cache-size", "64M",
                    "--log-file", str(m.log)]
            args += ["--cache-dir", str(cache_dir)] if cache_dir else []
            r = acpfs(*args, check=False)
            assert needle in one_line_error(r) and r.returncode == 2, (backing, r.stderr)
            assert not is_mounted(m.mnt) and not lock.exists()
        assert not Path(default_cache_dir(str(in_area))).exists()
        assert not (m.back / "cache").exists() and not (m.mnt / "cache").exists()
        assert not (tmp_path / "c2").exists()
        assert sorted(os.listdir(cache)) == ["back"] and os.listdir(m.back) == []
    finally:
        shutil.rmtree(in_area)
        if made_area:
            try:
                area.rmdir()
            except OSError:
                pass      # another mount of this user made its cache directory there meanwhile


def test_a_backing_on_a_ram_filesystem_is_mounted_with_a_warning(make_mount, faults):
    """A backing in RAM is allowed, with a warning: nothing in a tmpfs or ramfs backing survives
    a reboot. The mount goes on (tests and scratch space use such backings), and says so once,
    on stderr and in the log; a backing on a disk gets no such line."""
    disk = make_mount("disk", mount=False)
    r = acpfs(*disk.args())
    assert "RAM filesystem" not in r.stderr and "RAM filesystem" not in disk.log.read_text()
    disk.pid = disk.status()["pid"]
    for kind in ("tmpfs", "ramfs"):
        m = make_mount(kind, mount=False)
        if kind == "tmpfs":
            faults.tmpfs(m.back, "64M")
        else:
            subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0755", "ramfs", str(m.back)], check=True)
        try:
            r = acpfs(*m.args())
            m.pid = m.status()["pid"]
            said = (f"backing directory {m.back} is on a RAM filesystem ({kind}): nothing in it "
                    f"survives a reboot")
            lines = r.stderr.strip().splitlines()
            assert lines[-3].startswith("acpfs: mounted "), r.stderr
            assert lines[-2].startswith("acpfs: content store: "), r.stderr
            assert lines[-1] == f"acpfs: warning: {said}", r.stderr
            assert [line for line in m.log.read_text().splitlines() if said in line][0].split()[2] == "WARNING"
            (m.mnt / "f").write_bytes(b"x")
            m.sync()
            assert m.umount().returncode == 0
        finally:
            if kind == "ramfs":
                m.cleanup()
                subprocess.run(["umount", str(m.back)], check=True)


def test_mount_is_idempotent_and_race_safe(make_mount):
    m = make_mount(mount=False)
    procs = [subprocess.Popen(ACPFS + m.args(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    assert sum("already mounted" in err for _, err in outs) == 3
    m.pid = m.status()["pid"]
    mounts = [line for line in open("/proc/self/mounts") if line.split()[1] == str(m.mnt)]
    assert len(mounts) == 1
    r = acpfs(*m.args())
    assert "already mounted" in r.stderr


def test_status_json_schema_and_text(mnt):
    (mnt.mnt / "f").write_bytes(b"x" * 100000)
    mnt.sync()
    with open(mnt.mnt / "open", "wb") as f:
        f.write(b"y" * 5000)
        f.flush()
        doc = json.loads(acpfs("status", str(mnt.mnt), "--json", "--files").stdout)
        for key in ("version", "mountpoint", "backing", "pid", "cache", "dirty", "flushing", "queue",
                    "persisted_since_mount", "flush_rate_bytes_per_s", "oldest_dirty_age_s", "errors"):
            assert key in doc
        assert doc["version"] == 1
        assert doc["mountpoint"] == str(mnt.mnt) and doc["backing"] == str(mnt.back)
        assert doc["dirty"] == {"files": 1, "bytes": 5000}
        assert doc["cache"]["limit_bytes"] == 256 << 20
        assert doc["persisted_since_mount"]["files"] >= 1
        assert doc["oldest_dirty_age_s"] is not None
        assert {"path": "open", "state": "dirty", "size": 5000} in doc["files"]["files"]
        text = acpfs("status").stdout
        assert str(mnt.mnt) in text and "dirty      1 files" in text
        all_docs = json.loads(acpfs("status", "--json").stdout)
        assert any(d["mountpoint"] == str(mnt.mnt) for d in all_docs)


def test_umount_drains_with_progress(make_mount):
    m = make_mount()
    data = os.urandom(64 << 20)
    for i in range(4):
        (m.mnt / f"f{i}").write_bytes(data)
    r = m.umount()
    assert r.returncode == 0
    assert not is_mounted(m.mnt)
    assert "everything is persisted" in r.stderr
    for i in range(4):
        assert (m.back / f"f{i}").read_bytes() == data
    # the daemon has exited and removed its cache
    assert not m.cache_dir.exists()


def test_idle_unmount_is_quick(make_mount):
    """An idle mount unmounts well under a second (5 s here: a loaded CI
    machine); it used to take 8 to 30 s when another mount namespace held a copy."""
    m = make_mount()
    (m.mnt / "f").write_bytes(b"x")
    m.sync()
    for how in ("acpfs", "fusermount"):
        start = time.monotonic()
        if how == "acpfs":
            assert m.umount().returncode == 0
        else:
            subprocess.run(["fusermount3", "-u", str(m.mnt)], check=True)
        while not gone(m.pid):
            assert time.monotonic() - start < 5, f"idle unmount ({how}) took more than 5 s"
            time.sleep(0.02)
        if how == "acpfs":
            m.mount()


def test_unmount_names_another_mount_namespace_that_holds_the_mount(make_mount):
    """A copy of the mount in another mount namespace keeps the filesystem alive after it is
    unmounted here: the daemon serves it until that copy goes. Both the daemon's log and
    'acpfs umount' say so, naming the process, instead of waiting silently."""
    m = make_mount()
    (m.mnt / "f").write_bytes(b"x")
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "120"])
    try:
        time.sleep(0.5)                       # the namespace exists, with its copy of the mount
        um = subprocess.Popen(ACPFS + ["umount", str(m.mnt), "--timeout", "60"],
                              stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while f"pid {holder.pid}" not in m.log.read_text():
            assert time.monotonic() < deadline, "the daemon did not say who holds the mount"
            time.sleep(0.1)
        assert "other mount namespace(s) still hold it" in m.log.read_text()
        time.sleep(1.5)                       # 'acpfs umount' looks after a second of waiting
        assert um.poll() is None and not gone(m.pid)   # still serving it
    finally:
        holder.kill()
        holder.wait()
    _, err = um.communicate(timeout=60)
    assert um.returncode == 0, err
    assert f"the mount namespace of pid {holder.pid} (unshare)" in err or \
        f"the mount namespace of pid {holder.pid} (sleep)" in err, err
    assert "everything is persisted" in err
    assert (m.back / "f").read_bytes() == b"x"


@pytest.mark.parametrize("how", ["fusermount", "sigterm"])
def test_plain_unmount_or_sigterm_still_drains(make_mount, how):
    m = make_mount()
    data = os.urandom(32 << 20)
    for i in range(6):
        (m.mnt / f"f{i}").write_bytes(data)
    if how == "fusermount":
        subprocess.run(["fusermount3", "-u", str(m.mnt)], check=True)
    else:
        os.kill(m.pid, signal.SIGTERM)
    assert wait_gone(m.pid, 120)
    assert not is_mounted(m.mnt)
    for i in range(6):
        assert (m.back / f"f{i}").read_bytes() == data
    log = m.log.read_text()
    assert "all changes persisted" in log


def test_sync_path_waits_only_for_that_path_and_reports_open_files(mnt):
    (mnt.mnt / "d").mkdir()
    (mnt.mnt / "d" / "a").write_bytes(b"a" * 1000)
    with open(mnt.mnt / "d" / "open", "wb") as f:
        f.write(b"unsaved")
        f.flush()
        r = acpfs("sync", str(mnt.mnt / "d"), "--timeout", "60")
        assert "still open for writing" in r.stderr
        assert (mnt.back / "d" / "a").read_bytes() == b"a" * 1000
        assert not (mnt.back / "d" / "open").exists()
    acpfs("sync", str(mnt.mnt / "d" / "open"), "--timeout", "60")
    assert (mnt.back / "d" / "open").read_bytes() == b"unsaved"


def test_state_xattr_per_file(mnt):
    with open(mnt.mnt / "f", "wb") as f:
        f.write(b"x")
        f.flush()
        out = subprocess.run(["getfattr", "-n", "user.acpfs.state", "--only-values", str(mnt.mnt / "f")],
                             capture_output=True, text=True, check=True).stdout
        assert out == "dirty"
    mnt.sync()
    assert mnt.state("f") == "persisted"
    assert mnt.state(".") == "persisted"


def test_foreground_mount_logs_to_stderr_and_drains_on_sigint(make_mount):
    m = make_mount(mount=False)
    p = subprocess.Popen(ACPFS + m.args() + ["--foreground"], stderr=subprocess.PIPE, text=True)
    try:
        assert mounted_soon(m.mnt)
        m.pid = p.pid
        (m.mnt / "f").write_bytes(b"x" * 1000000)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0
        assert "mounted" in err and "all changes persisted" in err
        assert (m.back / "f").read_bytes() == b"x" * 1000000
    finally:
        if p.poll() is None:
            p.kill()


def test_stale_mount_is_detected_and_cleaned(make_mount):
    m = make_mount()
    os.kill(m.pid, signal.SIGKILL)
    time.sleep(0.5)
    r = acpfs("status", str(m.mnt), "--json", check=False)
    assert json.loads(r.stdout)["stale"] is True
    assert r.returncode == 1 and "is gone" in r.stderr
    r = acpfs("umount", str(m.mnt))
    assert "stale" in r.stderr
    assert not is_mounted(m.mnt)
    # and mounting again over the same backing works
    m.mount()
    assert is_mounted(m.mnt)


def test_every_command_on_a_stale_mount_says_so(make_mount):
    """A stale mount is reported, not walked: right after the daemon is killed, the kernel still
    answers stat of the mount point from its caches (kept up to --coherence-timeout), so `acpfs
    preload MOUNT` walked nothing and said "preloaded 0 files" with exit 0. Every command given
    a path on the stale mount says the daemon is gone, in one line, and exits 1."""
    m = make_mount(extra=("--coherence-timeout", "5"))
    (m.mnt / "d").mkdir()
    (m.mnt / "d" / "f").write_bytes(b"x" * 1000)
    m.sync()
    r = acpfs("temps", str(m.mnt), check=False)          # a mount hides them: not the place
    assert f"give its backing directory, {m.back}" in one_line_error(r) and r.returncode == 2
    os.stat(m.mnt)
    os.stat(m.mnt / "d")                 # their attributes are in the kernel's caches now
    os.kill(m.pid, signal.SIGKILL)
    assert wait_gone(m.pid, 30)
    for args in (("preload", str(m.mnt)), ("preload", str(m.mnt / "d")), ("sync", str(m.mnt)),
                 ("sync", str(m.mnt / "d")), ("status", str(m.mnt)), ("temps", str(m.mnt))):
        r = acpfs(*args, check=False)
        line = one_line_error(r)
        assert r.returncode == 1, (args, r.stderr)
        assert line == f"acpfs: {args[1]}: the daemon of the acpfs mount {m.mnt} is gone; " \
                       f"run 'acpfs umount {m.mnt}'", (args, line)
        assert "preloaded" not in r.stdout + r.stderr
    r = acpfs("status", str(m.mnt), "--json", check=False)
    assert r.returncode == 1 and json.loads(r.stdout) == {"mountpoint": str(m.mnt), "stale": True}
    assert "STALE" in acpfs("status").stdout         # the list of every mount is a report
    r = acpfs("umount", str(m.mnt))
    assert "daemon of this mount is gone" in r.stderr and not is_mounted(m.mnt)


def test_temps_lists_and_removes_only_old_leftovers_of_no_live_daemon(make_mount):
    """Leftovers of dead daemons in a shared backing: temporary files of a daemon whose cache
    directory is gone stay in a shared backing for good; 'acpfs temps' lists them with their age
    and removes, when asked and confirmed, those old enough that belong to no daemon on this
    host."""
    m = make_mount()
    inst = m.status()["instance"]
    back = m.back
    (back / "d").mkdir()
    dead_old = back / "d" / ".acpfs-tmp-0123456789ab-00112233445566ff"
    dead_old.write_bytes(b"x" * 5000)
    os.utime(dead_old, (time.time() - 3 * 86400,) * 2)
    staging = back / ".acpfs-tmp-0123456789ab-staging"     # with a file in it
    staging.mkdir()
    (staging / ".acpfs-tmp-0123456789ab-aabbccddeeff0011-i7").write_bytes(b"y" * 100)
    for p in (staging / ".acpfs-tmp-0123456789ab-aabbccddeeff0011-i7", staging):
        os.utime(p, (time.time() - 3 * 86400,) * 2)
    recent = back / ".acpfs-tmp-fedcba987654-0011223344556677"   # another node's upload in flight?
    recent.write_bytes(b"z")
    live = back / f".acpfs-tmp-{inst}-8899aabbccddeeff"           # this host's live daemon
    live.write_bytes(b"w")
    os.utime(live, (time.time() - 3 * 86400,) * 2)
    r = acpfs("temps", str(back), "--older-than", "1d")
    assert "live: " in r.stdout and "too recent" in r.stdout and len(r.stdout.splitlines()) == 4
    assert "2 older than 1d and of no daemon on this host" in r.stderr
    # a daemon of this host that died over this backing: its journal names its instance,
    # and its staged files wait for the next mount's recovery
    waiting = Path(str(m.cache_dir) + "-dead")
    waiting.mkdir()
    (waiting / "journal").write_bytes(b"ACPFSJ02" + bytes(16) + b"123456789abc".ljust(16, b"\0"))
    rec = Path("/run/acpfs") / "mount-test-temps-dead.json"
    rec.write_text(json.dumps({"backing": str(back), "cache_dir": str(waiting)}))
    pending = back / ".acpfs-tmp-123456789abc-staging"
    pending.mkdir()
    os.utime(pending, (time.time() - 3 * 86400,) * 2)
    r = acpfs("temps", str(back), "--older-than", "1d", "--remove", check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "--yes" in one_line_error(r)     # no terminal: no silent removal
    assert dead_old.exists() and staging.exists()
    try:
        r = acpfs("temps", str(back), "--older-than", "1d", "--remove", "--yes")
        assert "awaiting recovery from" in r.stdout
    finally:
        rec.unlink()
    assert "removed 2 temporary files" in r.stderr
    assert not dead_old.exists() and not staging.exists()
    assert recent.exists() and live.exists() and pending.exists()
    live.unlink()


def test_non_finite_and_empty_values_and_a_dead_daemon_are_named(make_mount):
    m = make_mount()
    for args in (("sync", str(m.mnt), "--timeout", "nan"), ("umount", str(m.mnt), "--timeout", "inf"),
                 (*m.args(), "--cache-full-timeout", "nan"), (*m.args(), "--persist-open-after=-inf")):
        assert "not a finite number of seconds" in one_line_error(acpfs(*args, check=False)), args
    base = m.args()
    i = base.index("--cache-size")
    r = acpfs(*base[:i], "--cache-size", "", *base[i + 2:], check=False)
    assert "--cache-size is empty" in one_line_error(r)
    r = acpfs("sync", str(m.mnt), env={**os.environ, "ACPFS_CACHE_FULL_TIMEOUT": "nan"}, check=False)
    assert r.returncode == 0          # only mount reads it
    (m.mnt / "f").write_bytes(b"x")
    m.sync()
    os.kill(m.pid, signal.SIGKILL)
    time.sleep(0.3)
    for args in (("sync", str(m.mnt / "f")), ("preload", str(m.mnt / "f"))):
        line = one_line_error(acpfs(*args, check=False))
        assert "daemon of the acpfs mount" in line and "is gone" in line, line
    acpfs("umount", str(m.mnt))


def test_names_with_control_characters_cannot_forge_output_lines(mnt):
    """(Another user must not forge output lines.) Names are printed with control characters
    escaped: a name holding a newline cannot print a line of its own."""
    forged = "x\nacpfs: all changes persisted\r\x1b[2K"
    with open(mnt.mnt / forged, "wb") as f:
        f.write(b"pending")
        f.flush()
        out = acpfs("status", str(mnt.mnt), "--files").stdout
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith("acpfs: all changes")], out
    assert "\x1b" not in out and "\r" not in out
    assert any("x\\nacpfs: all changes persisted\\r\\x1b[2K" in line for line in lines), out
    r = acpfs("sync", str(mnt.mnt / (forged + "-missing")), check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_two_mounts_cannot_share_a_cache_directory(make_mount, tmp_path):
    """(Another user must not take over a cache directory.) A second daemon given a live
    daemon's cache directory is refused with one line; the first mount's pending data stays its
    own."""
    a = make_mount("a")
    b = make_mount("b", mount=False)
    (a.mnt / "pending").write_bytes(b"A" * 1000)
    r = acpfs("mount", str(b.mnt), "--backing", str(b.back), "--cache-size", "64M",
              "--cache-dir", str(a.cache_dir), "--log-file", str(b.log), check=False)
    assert "is in use by another live acpfs daemon" in one_line_error(r)
    assert not is_mounted(b.mnt)
    a.sync()
    assert (a.back / "pending").read_bytes() == b"A" * 1000
    assert not (b.back / "pending").exists()
    assert (a.mnt / "pending").read_bytes() == b"A" * 1000


def test_the_daemon_log_is_private(make_mount):
    """(Other users must not read the log, which names files.) The log is 0600, also one an
    older version left 0644."""
    m = make_mount(mount=False)
    m.log.write_text("an older daemon's line\n")
    os.chmod(m.log, 0o644)
    m.mount()
    (m.mnt / "secret-name").write_bytes(b"x")
    m.sync()
    assert stat.S_IMODE(os.stat(m.log).st_mode) == 0o600
    text = m.log.read_text()
    assert text.startswith("an older daemon's line\n") and "mounted" in text


def test_status_files_lists_every_pending_file_whatever_the_length_of_the_list(make_mount, faults):
    """(The pending list must not be cut short.) It is read page by page (an xattr value is at most
    64 KiB): 30 files with 4 KiB paths and 1,500 ordinary ones, held by a read-only backing,
    are all listed, each once, by `acpfs status --files` and its --json form. The
    100,000-file case is in tests/unit/test_control.py."""
    m = make_mount("files", cache_size="256M", mount=False)
    faults.tmpfs(m.back, "64M")
    faults.mount(m)
    deep = m.mnt.joinpath(*(f"{i:02d}" + "d" * 248 for i in range(15)))
    deep.mkdir(parents=True)
    (m.mnt / "many").mkdir()
    m.sync()
    faults.remount(m.back, "ro")
    want = set()
    for i in range(30):
        p = deep / (f"{i:02d}" + "f" * 200)
        p.write_bytes(b"x")
        want.add(str(p.relative_to(m.mnt)))
    assert len(str(p.relative_to(m.mnt)).encode()) > 3900
    for i in range(1500):
        (m.mnt / "many" / f"shard-{i:05d}.bin").write_bytes(b"y")
        want.add(f"many/shard-{i:05d}.bin")
    doc = json.loads(acpfs("status", str(m.mnt), "--json", "--files").stdout)
    paths = [f["path"] for f in doc["files"]["files"]]
    assert doc["files"]["total"] == 1530 and sorted(paths) == sorted(want)
    text = acpfs("status", str(m.mnt), "--files").stdout
    listed = [line.split()[-1] for line in text.splitlines() if line.endswith(".bin") or line.endswith("f" * 200)]
    assert sorted(listed) == sorted(want)
    faults.remount(m.back, "rw")
    m.sync(timeout=120)
