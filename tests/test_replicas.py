"""Replicas of unsaved changes (``--replicas 1``) on the N-node fixture: a node lost before
its flusher finished loses nothing it replicated; another node persists it, in its order
(docs/semantics.md, "What survives what")."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import threading
import time

from conftest import ACPFS, wait_for, wait_gone
from test_peer_plane import PEERS, Cluster, known_peers

MIB = 1 << 20
LEASE = ("--peer-lease", "3", "--peer-heartbeat", "0.5")
REPLICAS = PEERS + ("--replicas", "1") + LEASE


def lose(node) -> None:
    """The node is lost with its RAM: its daemon killed, its cache directory (memory
    files, journal) gone, its mount detached."""
    os.kill(node.pid, signal.SIGKILL)
    assert wait_gone(node.pid, 30)
    subprocess.run(node.enter() + ["umount", "-l", str(node.mnt)], capture_output=True)
    subprocess.run(["umount", "-l", str(node.cache_dir)], capture_output=True)
    shutil.rmtree(node.cache_dir, ignore_errors=True)
    node.pid = None


def test_a_lost_node_loses_nothing_it_replicated(faults, tmp_path):
    cluster = Cluster(faults, tmp_path)
    b = cluster.node("b", view=False, extra=REPLICAS)
    a = cluster.node("a", view=True, extra=REPLICAS)
    known_peers(a, 1)
    a_instance = a.status()["peers"]["instance"]
    # A's flusher is held: the backing does not answer its creates and mkdirs
    cluster.views["a"].set("hang create mkdir")
    rnd = random.Random(7)
    files = {f"step_1/shard{i}.bin": rnd.randbytes(MIB + i) for i in range(7)}
    a.path("step_1").mkdir()
    for rel, data in files.items():
        a.path(rel).write_bytes(data)
    a.path("latest.tmp").write_text("step_1")
    os.rename(a.path("latest.tmp"), a.path("latest"))
    sending = lambda: a.status()["replicas"]["sending"]   # noqa: E731
    wait_for(lambda: sending()["owed_records"] == 0, 30, "A's changes replicated")
    assert sending()["holder"] == b.status()["peer_plane"]["address"]
    held = b.status()["replicas"]["held"][a_instance]
    assert held["bytes"] >= sum(map(len, files.values())), held
    assert not (cluster.shared / "latest").exists() and not (cluster.shared / "step_1").exists()
    lose(a)
    cluster.views["a"].set("ok")
    # B persists all of it within the lease and one flush, in A's order
    wait_for(lambda: (cluster.shared / "latest").exists(), 60, "A's changes persisted by B")
    for rel, data in files.items():
        assert (cluster.shared / rel).read_bytes() == data, rel
    assert (cluster.shared / "latest").read_text() == "step_1"
    assert not (cluster.shared / "latest.tmp").exists()
    last_shard = max((cluster.shared / rel).stat().st_ctime_ns for rel in files)
    assert (cluster.shared / "latest").stat().st_ctime_ns >= last_shard
    wait_for(lambda: b.status()["replicas"]["takeovers"].get(a_instance, {}).get("state") == "done",
             60, "B's takeover done")
    st = b.status()["replicas"]
    assert a_instance not in st["held"] and st["held_bytes"] == 0, st
    # B reads them through its own mount, and A's record says it left
    assert b.path("latest").read_text() == "step_1"
    wait_for(lambda: any(p["instance"] == a_instance and p["state"] == "left"
                         for p in b.status()["peers"]["peers"]), 30, "A's record left")
    b.run(*ACPFS, "umount", str(b.mnt))


def test_changes_a_holder_has_no_room_for_stay_owed_and_are_said(faults, tmp_path):
    """B's replica budget is smaller than A's file: the batch is refused, A's status says
    what is not copied and why (text, JSON, Prometheus), and nothing is lost: A persists it
    itself once its backing answers, and then owes nothing."""
    cluster = Cluster(faults, tmp_path)
    b = cluster.node("b", view=False, extra=PEERS + ("--replica-budget", "1M") + LEASE)
    a = cluster.node("a", view=True, extra=REPLICAS)
    known_peers(a, 1)
    cluster.views["a"].set("hang create")
    data = os.urandom(3 * MIB)
    a.path("big.bin").write_bytes(data)
    sending = lambda: a.status()["replicas"]["sending"]   # noqa: E731
    wait_for(lambda: "budget" in (sending()["error"] or ""), 30, "the budget refusal")
    st = sending()
    assert st["owed_records"] >= 1 and st["owed_bytes"] >= len(data), st
    held = b.status()["replicas"]
    assert held["refused_batches"] >= 1 and held["held_bytes"] <= 1 << 20, held
    text = a.run(*ACPFS, "status", str(a.mnt)).stdout
    assert "NOT YET COPIED" in text and "budget" in text, text
    prom = a.run(*ACPFS, "status", "--prometheus", str(a.mnt)).stdout
    owed = [line for line in prom.splitlines() if line.startswith("acpfs_replica_owed_bytes")]
    assert owed and float(owed[0].split()[-1]) >= len(data), owed
    cluster.views["a"].set("ok")
    a.sync()
    assert (cluster.shared / "big.bin").read_bytes() == data
    wait_for(lambda: sending()["owed_records"] == 0, 30, "nothing owed once persisted")


def test_replicas_need_the_peer_plane_and_take_0_or_1(tmp_path):
    back, mnt = tmp_path / "back", tmp_path / "mnt"
    back.mkdir()
    mnt.mkdir()
    for args, said in ((["--replicas", "1"], "--replicas 1 needs --peers-listen"),
                       (["--replicas", "2", "--peers-listen", "127.0.0.1:0"], "invalid --replicas"),
                       (["--replica-budget", "lots", "--peers-listen", "127.0.0.1:0"], "replica budget")):
        r = subprocess.run(ACPFS + ["mount", str(mnt), "--backing", str(back), *args],
                           capture_output=True, text=True)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_pointer_on_another_node_waits_for_the_lost_nodes_replicated_data(faults, tmp_path):
    """Global order through a takeover: A's shards are acknowledged (and copied to B), then B
    writes ``latest`` pointing at them. A is lost with its flusher held. ``latest`` never
    appears in the backing before every shard is there whole, though B lands both: its own
    pointer and, from the replica, A's shards."""
    cluster = Cluster(faults, tmp_path)
    b = cluster.node("b", view=False, extra=REPLICAS)
    a = cluster.node("a", view=True, extra=REPLICAS)
    known_peers(a, 1)
    known_peers(b, 1)
    cluster.views["a"].set("hang create mkdir")
    rnd = random.Random(11)
    files = {f"step_2/shard{i}.bin": rnd.randbytes(MIB // 2 + i) for i in range(5)}
    a.path("step_2").mkdir()
    for rel, data in files.items():
        a.path(rel).write_bytes(data)
    wait_for(lambda: a.status()["replicas"]["sending"]["owed_records"] == 0, 30, "A replicated")
    b.path("latest").write_text("step_2")        # after A's closes: ordered after them
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:   # the backing as any reader sees it
        while not stop.is_set():
            if (cluster.shared / "latest").exists():
                for rel, data in files.items():
                    p = cluster.shared / rel
                    if not p.exists() or p.stat().st_size != len(data):
                        seen.append(f"latest before {rel}")
                return
            time.sleep(0.002)
    t = threading.Thread(target=watch)
    t.start()
    try:
        time.sleep(1.0)   # B holds latest back: A, live, has not persisted its shards
        assert not (cluster.shared / "latest").exists()
        lose(a)
        cluster.views["a"].set("ok")
        wait_for(lambda: (cluster.shared / "latest").exists(), 60, "latest persisted")
    finally:
        stop.set()
        t.join()
    assert not seen, seen
    for rel, data in files.items():
        assert (cluster.shared / rel).read_bytes() == data, rel
    assert (cluster.shared / "latest").read_text() == "step_2"
    b.run(*ACPFS, "umount", str(b.mnt))


def test_replica_wait_and_sync_replicated_return_once_another_node_holds_the_copy(faults, tmp_path):
    """--replica-wait: close() returns once B holds what it acknowledged (B's status says so
    right after it, with A's backing holding nothing); ``acpfs sync --replicated`` waits for
    the copy, not the backing."""
    cluster = Cluster(faults, tmp_path)
    b = cluster.node("b", view=False, extra=REPLICAS)
    a = cluster.node("a", view=True, extra=REPLICAS + ("--replica-wait",))
    known_peers(a, 1)
    a_instance = a.status()["peers"]["instance"]
    cluster.views["a"].set("hang create")
    data = os.urandom(2 * MIB)
    a.path("x.bin").write_bytes(data)      # close() returns: B holds it
    held = b.status()["replicas"]["held"][a_instance]
    assert held["bytes"] >= len(data), held
    assert not (cluster.shared / "x.bin").exists()
    more = os.urandom(MIB)
    with open(a.path("y.bin"), "wb") as f:
        f.write(more)
    a.run(*ACPFS, "sync", "--replicated", str(a.mnt), "--timeout", "30")
    assert b.status()["replicas"]["held"][a_instance]["bytes"] >= len(data) + len(more)
    assert a.status()["replicas"]["sending"]["owed_records"] == 0
    r = a.run(*ACPFS, "sync", "--replicated", "--all-nodes", str(a.mnt), check=False)
    assert r.returncode == 2 and "give one" in r.stderr
    cluster.views["a"].set("ok")
    a.sync()
    assert (cluster.shared / "x.bin").read_bytes() == data
    assert (cluster.shared / "y.bin").read_bytes() == more
