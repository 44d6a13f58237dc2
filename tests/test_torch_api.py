"""``acpfs.torch``: save/load/wait_persisted/preload on real mounts, and the automatic fallback to
the backing directory when the daemon dies (SIGKILL), hangs (SIGSTOP) or was unmounted.

The fallback tests never rely on a re-mount (crash recovery): after the daemon is gone they look
only at the backing directory, at files acknowledged by ``save`` and then ``wait_persisted``
before the failure, and at every file saved by fallback after it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import acpfs, is_mounted, wait_gone

torch = pytest.importorskip("torch")
import acpfs.torch as at  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WARNING = "saving directly to the backing directory"


def state(seed: int, n: int = 256) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, 256, generator=g), "b": torch.randn(256, generator=g).to(torch.bfloat16),
            "step": torch.tensor(seed)}


def assert_same(got: dict, ref: dict, where: str) -> None:
    assert set(got) == set(ref), where
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), f"{where}: {k} differs"


def temp_files(root: Path) -> list[str]:
    return [str(Path(d, n)) for d, _, files in os.walk(root) for n in files if ".acpfs-" in n]


def test_import_acpfs_does_not_import_torch():
    code = "import sys, acpfs, acpfs.commands.cli, acpfs.config; print('torch' in sys.modules, 'torch_npu' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert r.stdout.split() == ["False", "False"]
    code = "import sys, acpfs.torch; print('torch_npu' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert r.stdout.split() == ["False"]


def test_save_load_roundtrip_through_a_live_mount(make_mount):
    m = make_mount()
    ref = state(1)
    s = at.save(ref, m.mnt / "run" / "step_1" / "model.pt")   # parents are created
    assert s.route == "mount" and s.written == str(m.mnt / "run/step_1/model.pt")
    assert_same(at.load(m.mnt / "run/step_1/model.pt"), ref, "mount")
    assert at.wait_persisted(m.mnt / "run", timeout=60) is True
    assert at.wait_persisted(m.mnt / "run/step_1/model.pt", timeout=60) is True
    assert (m.back / "run/step_1/model.pt").read_bytes() == (m.mnt / "run/step_1/model.pt").read_bytes()
    assert_same(torch.load(m.back / "run/step_1/model.pt"), ref, "backing")
    assert_same(at.load(m.mnt / "run/step_1/model.pt", weights_only=True, map_location="cpu"), ref, "kwargs")
    assert temp_files(m.back) == [] and temp_files(m.mnt) == []
    # a plain path (no acpfs anywhere): torch.save + fsync
    s = at.save(ref, m.root / "plain.pt")
    assert s.route == "plain"
    assert_same(at.load(m.root / "plain.pt"), ref, "plain")
    assert at.wait_persisted(m.root / "plain.pt") is True
    with pytest.raises(FileNotFoundError):
        at.wait_persisted(m.root / "nope.pt")


LOOP = textwrap.dedent("""
    import json, sys, time, torch
    sys.path.insert(0, sys.argv[4])
    import acpfs.torch as at
    from test_torch_api import state
    mnt, steps, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    at.configure(timeout=30)
    with open(log, "a") as out:
        for step in range(steps):
            t0 = time.monotonic()
            s = at.save(state(step, n=2048), f"{mnt}/step_{step:03d}/model.pt")  # 2 MiB
            l = at.save({"step": step}, f"{mnt}/latest.pt")
            durable = None
            if step % 3 == 0:
                try:
                    durable = at.wait_persisted(f"{mnt}/step_{step:03d}", timeout=30)
                except at.NotPersisted as e:
                    durable = False
            out.write(json.dumps({"step": step, "route": s.route, "latest": l.route, "durable": durable,
                                  "secs": time.monotonic() - t0}) + "\\n")
            out.flush()
            time.sleep(0.05)
""")


def test_training_loop_survives_a_killed_daemon(make_mount, tmp_path):
    m = make_mount()
    log = tmp_path / "steps.jsonl"
    log.touch()
    steps = 30
    p = subprocess.Popen([sys.executable, "-c", LOOP, str(m.mnt), str(steps), str(log), str(REPO / "tests")],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while len(log.read_text().splitlines()) < 8:
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline, "the loop did not get going"
            time.sleep(0.05)
        os.kill(m.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    routes = [r["route"] for r in rows]
    assert routes[0] == "mount" and routes[-1] == "backing", routes
    first = routes.index("backing")
    assert set(routes[first:]) == {"backing"} and set(routes[:first]) == {"mount"}, routes
    assert all(r["latest"] == "backing" for r in rows[first + 1:]), rows
    assert max(r["secs"] for r in rows) < 15, rows
    assert err.count(WARNING) == 1, err
    assert str(m.mnt) in err and "daemon is gone" in err, err
    for r in rows:
        f = m.back / f"step_{r['step']:03d}" / "model.pt"
        if r["route"] == "backing" or r["durable"]:
            assert_same(torch.load(f, weights_only=True), state(r["step"], n=2048), str(f))
        if r["route"] == "backing" and r["durable"] is not None:
            assert r["durable"] is True
    assert any(r["durable"] for r in rows[:first]), "no step was made durable before the kill"
    assert torch.load(m.back / "latest.pt") == {"step": steps - 1}
    assert [f for f in temp_files(m.back) if "fallback" in f] == []
    # this process, on the stale mount: load and wait_persisted answer from the backing
    assert is_mounted(m.mnt)          # stale until cleaned up
    last = f"step_{steps - 1:03d}"
    assert_same(at.load(m.mnt / last / "model.pt", mmap=True), state(steps - 1, n=2048), "stale load")
    assert at.wait_persisted(m.mnt / last, timeout=10) is True
    with pytest.raises(at.NotPersisted, match="daemon of .* is gone"):
        at.wait_persisted(m.mnt / "never-saved.pt", timeout=10)
    r = acpfs("umount", str(m.mnt), check=False)
    assert r.returncode == 0 and not is_mounted(m.mnt), r.stderr


def held_mount(make_mount, faults, tmp_path):
    """A mount over a faultfs view of ``tmp_path/src``, its root read, the backing then held:
    what is saved through it is acknowledged and stays pending. Returns (mount, shim, src)."""
    m = make_mount("m", mount=False)
    src = tmp_path / "src"
    shim = faults.shim(src, m.back)
    faults.mount(m)
    os.listdir(m.mnt)                              # the mount has read the backing root
    shim.set("hang rename")                        # nothing lands from here on (reads answer)
    return m, shim, src


def test_files_lost_with_a_killed_daemon_are_reported(make_mount, faults, tmp_path, caplog):
    """A checkpoint acknowledged through the mount but not yet persisted when the daemon is
    killed is lost: the fallback warning names it and wait_persisted raises NotPersisted."""
    m, shim, src = held_mount(make_mount, faults, tmp_path)
    assert at.save(state(1), m.mnt / "step_1" / "model.pt").route == "mount"
    assert at.save(state(0), m.mnt / "ok.pt").route == "mount"   # queued behind it
    with pytest.raises(TimeoutError):
        at.wait_persisted(m.mnt / "step_1", timeout=0.5)
    os.kill(m.pid, signal.SIGKILL)
    shim.set("ok")
    with caplog.at_level(logging.WARNING, logger="acpfs.torch"):
        s = at.save({"latest": 2}, m.mnt / "latest.pt")
        assert at.save(state(2), m.mnt / "step_2" / "model.pt").route == "backing"
    assert s.route == "backing" and "daemon is gone" in s.reason
    warnings = [r.getMessage() for r in caplog.records if r.name == "acpfs.torch"]
    assert len(warnings) == 1 and "LOST" in warnings[0], warnings
    assert "step_1/model.pt" in warnings[0] and "ok.pt" in warnings[0], warnings
    with pytest.raises(at.NotPersisted):
        at.wait_persisted(m.mnt / "step_1/model.pt", timeout=5)
    assert at.wait_persisted(m.mnt / "step_2", timeout=5) is True
    assert_same(at.load(m.mnt / "step_2/model.pt"), state(2), "fallback")
    shutil.rmtree(src / "step_1", ignore_errors=True)   # the mkdir the dead daemon had sent
    (src / "step_1").write_text("in the way")
    with pytest.raises(NotADirectoryError):            # a real error is not hidden by the fallback
        at.save(state(1), m.mnt / "step_1" / "model.pt")


def test_remount_after_a_kill_does_not_roll_back_a_fallback_save(make_mount, faults, tmp_path):
    """latest.pt acknowledged through the mount (not yet persisted), the daemon killed, a newer
    latest.pt saved by fallback: a new mount (which may recover the dead daemon's unfinished
    work) must not put the older acknowledged version over the newer one in the backing."""
    m, shim, _ = held_mount(make_mount, faults, tmp_path)
    at.save(state(1), m.mnt / "step_1" / "model.pt")
    at.save({"step": 1}, m.mnt / "latest.pt")
    os.kill(m.pid, signal.SIGKILL)
    shim.set("ok")                                  # the backing answers again
    assert at.save({"step": 2}, m.mnt / "latest.pt").route == "backing"
    assert wait_gone(m.pid, 30)                     # the dead daemon may take a moment to exit
    m.mount()
    m.sync(timeout=60)
    assert torch.load(m.back / "latest.pt") == {"step": 2}
    assert at.load(m.mnt / "latest.pt") == {"step": 2}
    # and what the dead daemon had acknowledged elsewhere is recovered
    assert torch.load(m.back / "step_1" / "model.pt")["step"] == 1


def test_unmounted_mount_point_falls_back_to_the_recorded_backing(make_mount, tmp_path, caplog):
    m = make_mount()
    at.save(state(0), m.mnt / "a.pt")
    m.umount()
    assert not is_mounted(m.mnt)
    with caplog.at_level(logging.WARNING, logger="acpfs.torch"):
        s = at.save(state(1), m.mnt / "step_1" / "model.pt")
        at.save(state(2), m.mnt / "step_2" / "model.pt")
    assert s.route == "backing" and s.written == str(m.back / "step_1/model.pt")
    assert os.listdir(m.mnt) == [], "wrote into the bare mount point directory"
    assert [r.name for r in caplog.records].count("acpfs.torch") == 1
    assert_same(torch.load(m.back / "step_1/model.pt"), state(1), "backing")
    assert_same(at.load(m.mnt / "step_2/model.pt"), state(2), "load via record")
    assert_same(at.load(m.mnt / "a.pt", mmap=True), state(0), "persisted before umount")
    assert at.wait_persisted(m.mnt / "step_1/model.pt") is True
    assert at.wait_persisted(m.mnt) is True
    with pytest.raises(at.NotPersisted):
        at.wait_persisted(m.mnt / "never-saved.pt")
    assert temp_files(m.back) == [] and os.listdir(m.mnt) == []
    # an explicit backing for a mount point without a record, and the environment variable
    bare, back2 = tmp_path / "bare", tmp_path / "back2"
    bare.mkdir()
    back2.mkdir()
    at.configure(mountpoint=bare, backing=back2)
    assert at.save(state(3), bare / "x.pt").route == "backing"
    assert (back2 / "x.pt").exists() and os.listdir(bare) == []
    bare3, back3 = tmp_path / "bare3", tmp_path / "back3"
    bare3.mkdir()
    back3.mkdir()
    os.environ["ACPFS_MOUNTPOINT"], os.environ["ACPFS_BACKING"] = str(bare3), str(back3)
    try:
        assert at.save(state(4), bare3 / "sub/y.pt").route == "backing"
    finally:
        del os.environ["ACPFS_MOUNTPOINT"], os.environ["ACPFS_BACKING"]
    assert (back3 / "sub/y.pt").exists() and os.listdir(bare3) == []


def blocked_writers() -> list[threading.Thread]:
    """The writer threads of acpfs.torch.save still running: a save returns only after its
    writer finished, unless it gave up on a hung mount and left the writer blocked in it."""
    return [th for th in threading.enumerate() if th.name.startswith("acpfs-torch-save ")]


def test_hung_daemon_times_out_to_the_backing(make_mount):
    m = make_mount()
    (m.mnt / "d").mkdir()
    at.save({"v": "A0"}, m.mnt / "d" / "latest.pt")
    at.wait_persisted(m.mnt / "d", timeout=60)
    os.kill(m.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        s = at.save({"v": "A"}, m.mnt / "d" / "latest.pt", timeout=2)
        took = time.monotonic() - t0
        assert s.route == "backing" and "hung" in s.reason and 2 <= took < 10, (s, took)
        assert torch.load(m.back / "d/latest.pt") == {"v": "A"}
        writers = blocked_writers()   # the writer of "A", given up on and still blocked
        assert len(writers) == 1 and writers[0].name.endswith("/d/latest.pt"), writers
        t0 = time.monotonic()   # the mount is not tried again by this process
        s = at.save({"v": "B"}, m.mnt / "d" / "latest.pt", timeout=2)
        assert s.route == "backing" and time.monotonic() - t0 < 3
        assert at.wait_persisted(m.mnt / "d/latest.pt", timeout=5) is True
        assert at.load(m.mnt / "d/latest.pt") == {"v": "B"}   # from the backing: no hang
    finally:
        os.kill(m.pid, signal.SIGCONT)
    for th in blocked_writers():
        th.join(60)
    assert blocked_writers() == []
    m.sync(timeout=60)
    # the abandoned write of "A" finished after the resume but never replaced the newer "B"
    assert torch.load(m.back / "d/latest.pt") == {"v": "B"}
    assert temp_files(m.back) == [] and temp_files(m.mnt) == []
    assert m.status()["errors"] == []


def test_preload_python_and_cli(make_mount, tmp_path):
    m = make_mount(mount=False, cache_size="8M")
    (m.back / "ckpt").mkdir()
    for i in range(3):
        torch.save({"w": torch.full((1000, 1000), float(i))}, m.back / "ckpt" / f"shard{i}.pt")  # ~3.8 MiB
    (m.back / "small").mkdir()
    torch.save(state(5, n=16), m.back / "small" / "s.pt")
    m.mount()
    before = m.status()["cache"]
    r = at.preload([m.mnt / "small"])
    assert (r.files, r.left_out) == (1, []) and r.bytes == (m.back / "small/s.pt").stat().st_size
    after = m.status()["cache"]
    assert after["cached_files"] > before["cached_files"] and after["used_bytes"] > before["used_bytes"]
    assert at.preload([tmp_path]) == at.Preloaded(0, 0, [])       # not on acpfs: no-op
    # mmap=True load of a cached file
    assert_same(at.load(m.mnt / "small/s.pt", mmap=True, weights_only=True), state(5, n=16), "mmap")
    # the CLI: a summary line and exit 0, then more than the cache: exit 1 listing what did not fit
    r = acpfs("preload", str(m.mnt / "small"))
    assert "preloaded 1 files" in r.stderr, r.stderr
    r = acpfs("preload", str(m.mnt / "ckpt"), check=False)
    assert r.returncode == 1, r.stderr
    assert "not loaded" in r.stderr and "did not fit" in r.stderr, r.stderr
    res = at.preload([m.mnt / "ckpt"])
    assert 1 <= res.files < 3 and len(res.left_out) == 3 - res.files
    # a byte budget: the files from the first one past it on are not read
    res = at.preload([m.mnt / "ckpt"], max_bytes=1 << 20)
    assert (res.files, res.left_out) == (0, []) and len(res.over_budget) == 3, res
    with pytest.raises(ValueError, match="max_bytes"):
        at.preload([m.mnt / "ckpt"], max_bytes=-1)
    # a path on no acpfs mount: one line on stderr, non-zero exit
    r = acpfs("preload", str(tmp_path), check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not on an acpfs mount" in r.stderr


def test_torch_npu_tensors(make_mount):
    torch_npu = pytest.importorskip("torch_npu")  # noqa: F841
    if not torch.npu.is_available():
        pytest.skip("no NPU device")
    m = make_mount()
    t = torch.randn(64, 64).npu()
    at.save({"t": t}, m.mnt / "npu.pt")
    got = at.load(m.mnt / "npu.pt", map_location="npu:0")
    assert got["t"].device.type == "npu" and torch.equal(got["t"].cpu(), t.cpu())
    at.wait_persisted(m.mnt / "npu.pt", timeout=60)
    assert torch.equal(torch.load(m.back / "npu.pt", map_location="cpu")["t"], t.cpu())
