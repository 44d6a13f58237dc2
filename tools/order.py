"""What global order costs a healthy cluster: the delay it adds to ``latest``, to close(), and
the metadata operations each node makes on the shared backing.

    ./tools/order [--nodes 2 8] [--rounds 8] [--shard-mb 16]

For each node count, simulated nodes (mount namespaces over one backing directory, as in the
test suite) run checkpoint rounds twice, with ``--global-order on`` and ``off``, side by
side: every node writes a shard of ``step_k`` at once, then node 0 writes ``latest``. It
prints, for each setting, the median time from ``latest``'s close() to its arrival in the
backing (polled every millisecond), the median time a shard's write+close took, and the
record operations per second of an idle node (the nodes' own count, ``status.peers.ops``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from conftest import Node, Worker  # noqa: E402


def rounds(nodes: list[Node], n: int, units: int, back: Path, tag: str) -> tuple[list[float], list[float]]:
    workers = [Worker(node) for node in nodes]
    delays, writes = [], []
    try:
        for k in range(n):
            step = f"{tag}_{k}"
            times = [0.0] * len(nodes)

            def save(i: int) -> None:
                t = time.monotonic()
                workers[i].do("write", f"{step}/shard_{i}", f"{step}-{i}", units)
                times[i] = time.monotonic() - t
            threads = [threading.Thread(target=save, args=(i,)) for i in range(len(nodes))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            writes.extend(times)
            workers[0].do("point", f"latest_{tag}", step)
            wrote = time.monotonic()
            deadline = wrote + 120
            while True:
                try:
                    if (back / f"latest_{tag}").read_text() == step:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"latest never reached the backing ({tag}, round {k})")
                time.sleep(0.001)
            delays.append(time.monotonic() - wrote)
            time.sleep(0.5)
    finally:
        for w in workers:
            w.close()
    return delays, writes


def run(count: int, order: str, a: argparse.Namespace, work: Path) -> dict:
    root = work / f"{count}-{order}"
    back, mnt = root / "shared", root / "ckpt"
    back.mkdir(parents=True)
    mnt.mkdir()
    nodes = [Node(f"n{i}", root, back, mnt, cache_size="512M", extra=("--global-order", order))
             for i in range(count)]
    try:
        for node in nodes:
            node.mount()
        delays, writes = rounds(nodes, a.rounds, a.shard_mb << 15, back, order)
        ops = None
        if order == "on":
            time.sleep(2)
            o0, t0 = nodes[-1].status()["peers"]["ops"], time.monotonic()
            time.sleep(5)
            ops = (nodes[-1].status()["peers"]["ops"] - o0) / (time.monotonic() - t0)
        return {"latest": statistics.median(delays), "latest_max": max(delays),
                "write": statistics.median(writes), "ops": ops}
    finally:
        for node in nodes:
            node.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--shard-mb", type=int, default=16)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="acpfs-order-"))
    try:
        for count in a.nodes:
            on = run(count, "on", a, work)
            off = run(count, "off", a, work)
            print(f"{count} nodes, {a.rounds} rounds of {a.shard_mb} MiB shards:")
            print(f"  latest lands after   {on['latest'] * 1000:7.0f} ms with global order "
                  f"(max {on['latest_max'] * 1000:.0f}), {off['latest'] * 1000:7.0f} ms without "
                  f"(max {off['latest_max'] * 1000:.0f}): +{(on['latest'] - off['latest']) * 1000:.0f} ms")
            print(f"  shard write+close    {on['write'] * 1000:7.1f} ms with, {off['write'] * 1000:7.1f} ms "
                  f"without: {on['write'] / off['write']:.2f}x")
            print(f"  idle node            {on['ops']:.2f} record operations/s on the backing")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
