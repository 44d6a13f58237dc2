"""The `replicas` workload of tools/bench: what copying a node's unsaved changes to another
node's RAM costs the program that saves (docs/benchmarks.md, "Replicas of unsaved changes").

Two nodes over one backing directory (each mounts a bind mount of it: one mount per backing
path on a machine): B serves its plane and holds replicas; A saves, mounted three ways in
turn: without replicas, with `--replicas 1` (copied beside the program), and with
`--replica-wait` too (each close() returns once B holds the copy). The planes talk over
loopback.

Rows, per way: `replicas_save_*` (GB/s: torch.save of the state dict into A, close
included), `replicas_close_*` (ms: close() of a file of the same size just written, alone).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from typing import Callable

WAYS = {"none": [], "async": ["--replicas", "1"], "wait": ["--replicas", "1", "--replica-wait"]}


def run(bench, t, rep: int, make_mount: Callable[[str, str, list[str]], object],
        record: Callable[..., None]) -> dict:
    size = bench.args.size
    base = os.path.join(bench.tmp, f"replicas-{t.name}-r{rep}")
    shared = os.path.join(bench.bdir, f"replicas-{t.name}-r{rep}")
    views = [f"{base}-view-a", f"{base}-view-b"]
    os.makedirs(shared)
    mounted: list[str] = []
    b = None
    out: dict = {}
    try:
        for v in views:
            os.makedirs(v)
            subprocess.run(["mount", "--bind", shared, v], check=True)
            mounted.append(v)
        # room for the whole checkpoint: a close() under --replica-wait that finds no room
        # waits until its file is persisted instead (docs/design.md)
        b = make_mount(f"{base}-b", views[1], ["--peers-listen", "127.0.0.1:0",
                                               "--replica-budget", str(2 * size)])
        b.start()
        block = os.urandom(1 << 20)
        for way, extra in WAYS.items():
            a = make_mount(f"{base}-a-{way}", views[0], ["--peers-listen", "127.0.0.1:0", *extra])
            a.start()
            try:
                deadline = time.monotonic() + 30
                while not any(p.get("address") for p in a.status()["peers"]["peers"]
                              if p["state"] != "left"):
                    if time.monotonic() > deadline:
                        raise RuntimeError("node A did not see B's plane within 30 s")
                    time.sleep(0.1)
                d = os.path.join(a.root, f"save-{way}")
                os.makedirs(d)
                r = bench.w.call("torch_save", path=os.path.join(d, "model.pt"), fsync=False)
                record(f"replicas_save_{way}", t.name, rep, bench.size_gb() / r["s"])
                with open(os.path.join(d, "alone.bin"), "wb") as f:
                    for _ in range(size >> 20):
                        f.write(block)
                    f.flush()
                    start = time.perf_counter()
                record(f"replicas_close_{way}", t.name, rep, (time.perf_counter() - start) * 1e3)
                out[way] = (a.status().get("replicas") or {}).get("sending")
                a.sync()
            finally:
                a.stop()
        out["held"] = b.status()["replicas"]
        return out
    finally:
        if b is not None:
            with contextlib.suppress(Exception):
                b.stop()
        for v in mounted:
            subprocess.run(["umount", "-l", v], check=False)
        subprocess.run(["rm", "-rf", shared])
