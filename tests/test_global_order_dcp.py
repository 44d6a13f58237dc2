"""Global order with real torch.distributed.checkpoint across 2 nodes x 2 ranks (contract 11).

Node B reaches the shared directory through a faultfs view that answers every rename 1 s
late, so each of its shards lands in the backing about 1 s after its rank's close()
returned: a slow node. The ranks do nothing but ``dcp.save`` and, on rank 0, rewrite
``latest`` afterwards (no ``acpfs sync``, no call into acpfs): DCP gathers every rank's write
results before rank 0 writes ``.metadata``, so both pointers are written after every shard
was closed. A ``Watch`` polls the backing throughout: neither ``.metadata`` nor ``latest`` may
be there before every shard of its step. Then the backing, loaded without the mounts, holds
every rank's tensors exactly.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import Node
from test_global_order import Watch
from test_multinode_dcp import RANKS_PER_NODE, WORLD, expected, free_port, make_state

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

STEPS = 3
SLOW = 1.0

WORKER = "import torch\n" + inspect.getsource(make_state) + textwrap.dedent("""
    import datetime, os, sys
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    mnt, steps = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for step in range(steps):
        dcp.save(make_state(step, rank), checkpoint_id=os.path.join(mnt, f"step_{step}"))
        if rank == 0:
            with open(os.path.join(mnt, "latest"), "w") as f:
                f.write(f"step_{step}")
        dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
""")


def run_ranks(nodes, logs, timeout: float = 240) -> None:
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(WORLD), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in range(WORLD):
            node = nodes[rank // RANKS_PER_NODE]
            out = open(logs / f"rank{rank}.log", "w")
            procs.append(node.popen(sys.executable, "-c", WORKER, str(node.mnt), str(STEPS),
                                    env={**env, "RANK": str(rank)}, stdout=out,
                                    stderr=subprocess.STDOUT))
            out.close()
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(3)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * WORLD:
        report = "\n".join(f"--- rank {r}: {(logs / f'rank{r}.log').read_text()[-3000:]}"
                           for r in range(WORLD))
        pytest.fail(f"ranks exited {codes}\n{report}", pytrace=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")   # no_dist load
def test_dcp_metadata_and_latest_never_land_before_a_slow_nodes_shards(faults, tmp_path):
    shared, view = tmp_path / "shared", tmp_path / "view_b"
    shared.mkdir()
    view.mkdir()
    shim = faults.shim(shared, view)     # before node B's namespace: it holds a copy
    mnt = tmp_path / "ckpt"
    mnt.mkdir()
    node_a = faults.mount(Node("nodeA", tmp_path, shared, mnt, extra=("--peer-heartbeat", "0.25")))
    node_b = faults.mount(Node("nodeB", tmp_path, view, mnt, extra=("--peer-heartbeat", "0.25")))
    shim.set(f"slow {SLOW} rename")
    watch = Watch(shared)
    for step in range(STEPS):
        watch.expect[f"step_{step}"] = [f"__{r}_0.distcp" for r in range(WORLD)]
    watch.start()
    started = time.monotonic()
    try:
        run_ranks([node_a, node_b], tmp_path / "ranks")
        deadline = time.monotonic() + 60
        while f"latest=step_{STEPS - 1}" not in watch.seen:
            assert time.monotonic() < deadline, "latest never named the last step in the backing"
            time.sleep(0.05)
    finally:
        watch.stop()
        shim.set("ok")
    assert watch.polls > 1000, "the watch hardly looked at the backing"
    assert watch.ahead == [], f"a pointer reached the backing before the data: {watch.ahead[:5]}"
    # B's shards were slow: the pointers waited for them (the checks above could fail)
    assert time.monotonic() - started > STEPS * SLOW
    for node in (node_a, node_b):
        node.sync()
    assert (shared / "latest").read_text() == f"step_{STEPS - 1}"
    for step in range(STEPS):
        d = shared / f"step_{step}"
        assert sorted(os.listdir(d)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD)]
        want = expected(step)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, checkpoint_id=str(d), no_dist=True)
        bad = [k for k, v in want.items() if not torch.equal(got[k], v)]
        assert not bad, f"step_{step}: these tensors differ from what was saved: {bad}"
