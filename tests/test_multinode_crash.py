"""A node killed and recovered while another node's uploads are in flight:
the recovering node must leave the other node's temporary files alone.

Seen before: node A, restarted after a SIGKILL, removed ``.acpfs-tmp-...`` files it took for
its own dead daemon's leftovers while node B was uploading them; 17 of B's 20 files never
reached the backing. A recovering daemon may remove only the temporary files of the dead
daemon whose journal it replays (``.acpfs-tmp-<that instance>-*``), never another node's.

Each node reaches the one shared directory through its own faultfs view (created before the
nodes' mount namespaces, so each namespace holds a copy), so the test can hold one node's
uploads without touching the other's: B's backing writes hang, so its temporary files sit
in the shared directory, created but unfinished, for as long as A needs to die and recover;
A's writes hang too before its SIGKILL, so that the dead daemon leaves pending content (and
temporary files of its own, which its successor must remove).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

from acpfs.cluster.records import RecordName
from conftest import Node, Worker, content, wait_for

ROUNDS = int(os.environ.get("MULTINODE_CRASH_ROUNDS", "3"))
B_FILES = 20                    # per round: 14 into the shared step directory, 6 at the root
B_SIZE = 3 << 20
TMP = ".acpfs-tmp-"


def blob(rnd: random.Random, size: int) -> bytes:
    return rnd.randbytes(size)


def temps(root: Path, instance: str) -> set[str]:
    """Regular temporary files of one daemon instance anywhere under ``root`` (relative paths).
    Temporary directories (a mkdir in flight, renamed into place at once) are left out."""
    out = set()
    prefix = f"{TMP}{instance}-"
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if name.startswith(prefix):
                out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def kill(node: Node) -> None:
    os.kill(node.pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            with open(f"/proc/{node.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    wait_for(gone, what=f"{node.name}'s daemon to die", timeout=10)


def read_on(node: Node, rel: str, shared: Path) -> bytes:
    """``rel`` read through ``node``; a name the node says is missing fails with what helps
    tell why: whether the backing has it, the node's log lines that name it, its requests
    and backing calls (CI saw this once: a name another node had persisted, missing on A)."""
    try:
        return node.path(rel).read_bytes()
    except FileNotFoundError:
        name = os.path.basename(rel)
        lines = [ln for ln in node.log.read_text(errors="replace").splitlines() if name in ln]
        st = node.status()
        raise AssertionError(
            f"{node.name}: {rel} missing through the mount; in the backing: "
            f"{(shared / rel).exists()}; log lines naming it: {lines[-10:]}; requests: "
            f"{st.get('requests')}; at_once lookup: {st.get('at_once', {}).get('lookup')}; "
            f"backing calls: {st.get('backing_calls')}") from None


def settled(node: Node) -> None:
    st = node.status()
    q = st["queue"]
    assert st["errors"] == [], (node.name, st["errors"])
    assert q["pending_ops"] == 0 and q["applied_seq"] == q["last_seq"], (node.name, q)
    assert st["flusher_alive"], node.name


def test_recovery_never_removes_another_nodes_uploads_in_flight(faults, make_nodes, tmp_path):
    # ``faults`` first: its shims are closed after the nodes are unmounted
    shared = tmp_path / "shared"
    view_a, view_b = tmp_path / "view-a", tmp_path / "view-b"
    view_a.mkdir()
    view_b.mkdir()
    shim_a = faults.shim(shared, view_a)
    shim_b = faults.shim(shared, view_b)
    a, b = make_nodes(2, mount=False)          # their namespaces hold both views
    a.backing, b.backing = view_a, view_b
    rnd = random.Random(20261121)
    a_files: dict[str, bytes] = {}               # what A's close() acknowledged
    b_files: dict[str, bytes] = {}
    try:
        a.mount()
        b.mount()
        b_inst = b.status()["instance"]
        for r in range(ROUNDS):
            step = f"step_{r}"
            # A: some files persisted, then some acknowledged but held pending (writes hang)
            os.mkdir(a.path(step))
            new_a = {f"{step}/a_saved_{i}.bin": blob(rnd, (1 << 20) + 4099 * i) for i in range(3)}
            new_a[f"a_saved_{r}.bin"] = blob(rnd, 300_000)
            for rel, data in new_a.items():
                a.path(rel).write_bytes(data)
            a.sync()
            a_files.update(new_a)
            a_inst = a.status()["instance"]
            shim_a.set("hang write")
            pend_a = {f"{step}/a_pending_{i}.bin": blob(rnd, (2 << 20) + 977 * i) for i in range(4)}
            pend_a[f"a_pending_{r}.bin"] = blob(rnd, 500_000)
            pend_a["latest"] = step.encode()
            for rel, data in pend_a.items():
                a.path(rel).write_bytes(data)
            a_files.update(pend_a)
            wait_for(lambda: temps(shared, a_inst), what="A's first upload to start")
            q = a.status()["queue"]
            assert q["applied_seq"] < q["last_seq"], ("A has nothing pending", q)

            # B: 20 files whose uploads start and hang, their temporary files in the backing
            time.sleep(1.1)                      # B's view of the root lists step_r
            os.makedirs(b.path(step), exist_ok=True)
            shim_b.set("hang write")
            new_b = {}
            for i in range(B_FILES):
                rel = f"b_{r}_{i}.bin" if i % 3 == 2 else f"{step}/b_{i}.bin"
                new_b[rel] = blob(rnd, B_SIZE + 8191 * i)
                b.path(rel).write_bytes(new_b[rel])
            b_files.update(new_b)
            workers = b.status()["options"]["flush_workers"]

            def b_uploads() -> set[str] | None:      # in both directories, as many as B's workers
                t = temps(shared, b_inst)
                dirs = {os.path.dirname(p) for p in t}
                return t if len(t) >= workers and dirs == {"", step} else None
            in_flight = wait_for(b_uploads, what=f"{workers} of B's uploads to be in flight")

            # A dies with work pending and is recovered while B's uploads sit in the backing
            kill(a)
            shim_a.set("ok")
            dead_left = temps(shared, a_inst)
            assert dead_left, "the dead daemon left no temporary file: nothing for recovery to remove"
            a.mount()
            st = a.status()
            rec = st["recovery"]
            assert rec and rec["files"] >= 1 and rec["lost_open_files"] == [], rec
            assert st["instance"] != a_inst
            print(f"round {r}: {len(in_flight)} uploads of B in flight, {len(dead_left)} left by "
                  f"the dead A; recovery {rec}")
            # A lists every directory holding B's temporary files: at the remount, and again
            # after the coherence timeout, so the backing is listed anew
            for _ in range(2):
                assert set(pend_a) | set(new_a) <= {
                    f"{step}/{n}" for n in os.listdir(a.path(step))} | set(os.listdir(a.path()))
                time.sleep(1.1)
            # the overlap happened: B's uploads were in flight before the kill and are still
            # there, untouched, after A's recovery and listings (B's writes still hang, so B
            # cannot have renamed them)
            still = temps(shared, b_inst)
            assert in_flight <= still, (
                f"round {r}: A's recovery removed {len(in_flight - still)} of B's "
                f"{len(in_flight)} uploads in flight: {sorted(in_flight - still)}")
            q = b.status()["queue"]
            assert q["applied_seq"] < q["last_seq"], ("B's uploads finished while hung", q)
            # while the dead daemon's own leftovers were removed
            assert temps(shared, a_inst) == set(), sorted(temps(shared, a_inst))

            a.sync()
            bad = [p for p, d in a_files.items() if (shared / p).read_bytes() != d]
            assert bad == [], f"round {r}: A's acknowledged files differ in the backing: {bad}"

            shim_b.set("ok")
            b.sync()
            bad = [p for p, d in b_files.items() if (shared / p).read_bytes() != d]
            assert bad == [], f"round {r}: {len(bad)} of B's files differ in the backing: {bad}"
            assert temps(shared, b_inst) == set()
            settled(a)
            settled(b)

            # each node reads the other's files (close-to-open, within the coherence timeout)
            time.sleep(1.1)
            bad = [p for p, d in b_files.items() if read_on(a, p, shared) != d]
            assert bad == [], f"round {r}: A reads other bytes for B's files {bad}"
            bad = [p for p, d in a_files.items() if read_on(b, p, shared) != d]
            assert bad == [], f"round {r}: B reads other bytes for A's files {bad}"

        assert not list(shared.rglob(f"{TMP}*")), sorted(map(str, shared.rglob(f"{TMP}*")))
        log_b = b.log.read_text(errors="replace")
        assert "temporary file is gone" not in log_b   # no upload of B had to be written again
        assert f"removed '{TMP}{b_inst}-" not in a.log.read_text(errors="replace")
    finally:
        shim_a.set("ok")
        shim_b.set("ok")


def records(backing: Path) -> dict[str, RecordName]:
    """The node records of global order in ``backing`` (peers.py), by instance. A listing
    that crosses a rename may show a record twice (the newer counts, as in Peers._list) or
    not at all (callers look again)."""
    out: dict[str, RecordName] = {}
    for name in os.listdir(backing / ".acpfs-nodes"):
        r = RecordName.parse(os.fsencode(name))
        if r is not None and (r.instance not in out or r.version > out[r.instance].version):
            out[r.instance] = r
    return out


def test_a_node_restarted_at_once_after_a_sigkill_holds_nobody(make_nodes):
    """A daemon restarted at once must hold nobody: node A's daemon is SIGKILLed and ``acpfs
    mount`` runs again at once over the same cache (systemd's ``Restart=on-failure``) while node
    B publishes. B's ``acpfs sync`` took 27.4 s: B kept waiting for the dead instance's record
    (idle, its promise long run out) for a whole lease, although A had persisted everything and
    its successor had taken over. A restarted daemon holds nobody: the predecessor's record says
    so once the successor's own record covers what it acknowledged."""
    a, b = make_nodes(2)                       # the defaults: heartbeat 1 s, lease 30 s
    a.path("a0").write_bytes(b"a" * 100_000)
    b.path("b0").write_bytes(b"b" * 100_000)
    a.sync()
    b.sync()
    time.sleep(2.5)                            # every record renewed since: both idle, live
    dead = a.status()["instance"]
    wait_for(lambda: dead in records(a.backing), what="A's record", timeout=5)
    assert records(a.backing)[dead].state == "idle"

    w, pointer = Worker(b), Worker(b)          # B's job publishes all along
    stop = threading.Event()
    published: list[str] = []

    def publish() -> None:
        i = 0
        while not stop.is_set():
            w.do("write", f"steps/b_{i}", f"b{i}", 1000)
            published.append(f"steps/b_{i}")
            i += 1
            time.sleep(0.05)
    t = threading.Thread(target=publish, daemon=True)
    try:
        t.start()
        wait_for(lambda: len(published) >= 3, what="B to publish")
        kill(a)
        during = len(published)
        a.mount()                              # at once, over the same cache directory
        assert a.status()["instance"] != dead
        stop.set()
        t.join(30)
        assert len(published) > during, "B published nothing while A was dead and restarting"
        start = time.monotonic()               # B's sync covers what it published meanwhile
        pointer.do("point", "latest", "steps")
        b.sync(timeout=60)
        took = time.monotonic() - start
    finally:
        stop.set()
        t.join(30)
        w.close()
        pointer.close()
    print(f"\nB's sync after A's restart: {took:.2f} s")
    assert took < 5, f"B's sync took {took:.1f} s after A's restart: held by A's dead instance"
    for rel in published:
        assert (b.backing / rel).read_bytes() == content(f"b{rel.rsplit('_', 1)[1]}", 1000)
    # nobody waits for the dead instance: its record says it left (or is gone), and B has
    # no warning about waiting for any node
    gone = records(a.backing).get(dead)
    assert gone is None or gone.state == "left", gone
    peers = {p["instance"]: p["state"] for p in b.status()["peers"]["peers"]}
    assert peers.get(dead) in (None, "left"), peers
    assert "has waited" not in b.log.read_text()
    # a node with nothing pending advertises a frontier at or ahead of its clock
    a.sync()
    time.sleep(1.5)
    now = a.status()["instance"]
    mine = wait_for(lambda: records(a.backing).get(now), what="A's new record", timeout=5)
    assert mine.state == "idle" and mine.frontier >= mine.heartbeat, mine
