"""Replicas, wired into a daemon with a peer plane (docs/design.md, "Replicas of unsaved
changes"): what this node holds for others (``cluster.replicas.Replicas``, up to
``--replica-budget``, served by the plane's POSTs) and, with ``--replicas 1``, what it sends
of its own (``cluster.replicate.Replicator``, the op log's mirror).

Owns the wiring and nothing else: the peers' frontier and ``held`` count the oldest change
held for a node that may be dead (``_suspect``: its record older than half its lease, or
unknown); each listing of the records may drop replicas or start a takeover (``look``).
Lock order: the op log's lock (which the peers' ``frontier``, ``held`` and ``cleared`` run
under), then the replicas' own.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..backing.retry import describe
from ..cluster.auth import Refused, Secret
from ..cluster.peers import Peers
from ..cluster.plane import Plane
from ..cluster.remote import Remote
from ..cluster.replicas import Replicas
from ..cluster.replicate import Replicator
from ..config import Options
from ..core.peerreads import PeerPlane
from ..oplog.log import OpLog

log = logging.getLogger(__name__)

BUDGET_SHARE = 4   # default --replica-budget: a quarter of the cache size
SECRET_AT_MOUNT = 5.0   # s the mount waits to read (or make) the secret


def peer_plane(opts: Options, plane: Plane, peers: Peers, instance: str, oplog: OpLog,
               store: Any) -> tuple[PeerPlane, Replication | None]:
    """The peer plane's parts: its secret read (or made) in the records directory, its
    address put in this node's record (written next: ``Daemon._join``), and the replicas.
    Without a usable secret it serves and reads nothing and holds no replicas; the mount
    goes on, and status says why."""
    out: list = []

    def load() -> None:
        try:
            out.append(Secret.load(peers.records, instance))
        except (OSError, Refused) as e:
            out.append(e)
    t = threading.Thread(target=load, name="acpfs-secret-at-mount", daemon=True)
    t.start()
    t.join(SECRET_AT_MOUNT)
    got = out[0] if out else None
    if isinstance(got, Secret):
        plane.secret = got
        peers.address = plane.address
        remote = Remote(got)
        replication = Replication(opts, oplog, store, peers, plane, remote, instance)
        plane.start()
        return PeerPlane(peers, plane, remote), replication
    why = ("the backing does not answer" if got is None else describe(got)
           if isinstance(got, OSError) else str(got))
    log.warning("peer plane: off (%s); files are read from the backing alone, this node "
                "serves none%s", why, ", and its changes are not replicated" if opts.replicas else "")
    plane.start()   # it answers 401 to every request: a peer learns at once
    return PeerPlane(peers, plane, None, why), None


def recover_args(opts: Options) -> list[str]:
    """``acpfs recover``'s options for a takeover: this node's backing and global order."""
    return ["--backing", opts.backing, "--global-order", "on",
            "--max-clock-skew", repr(opts.max_clock_skew),
            "--peer-heartbeat", repr(opts.peer_heartbeat), "--peer-lease", repr(opts.peer_lease),
            "--log-level", opts.log_level]


class Replication:
    def __init__(self, opts: Options, oplog: OpLog, store: Any, peers: Peers, plane: Plane,
                 remote: Remote, instance: str) -> None:
        self.peers = peers
        self.oplog = oplog
        budget = opts.replica_budget or opts.cache_size // BUDGET_SHARE
        # beside the cache directory, not in it: a drained unmount removes that, and a
        # takeover may still run here (its recovery removes its own directory when done)
        self.held = Replicas(opts.cache_dir.rstrip("/") + ".replicas", budget, recover_args(opts))
        plane.replicas = self.held
        own = peers.frontier
        peers.held = lambda: self.held.frontier(self._suspect)

        def frontier() -> tuple[float, bool]:
            front, pending = own()
            h = peers.held()
            return (h, True) if h is not None and h < front else (front, pending)
        peers.frontier = frontier
        peers.on_listed = self._look
        self.sender: Replicator | None = None
        if opts.replicas:
            self.sender = Replicator(store, remote, instance, self._holders)
            oplog.mirror = self.sender   # before the recovery replays: its changes are sent too

    def _suspect(self, origin: str) -> bool:
        """(the op log's lock held) Whether ``origin`` may be dead: its record is older than
        half its lease, or not known; not any more after two leases without a takeover (its
        plane answers, it hangs: what it holds back is bounded, as for any node)."""
        p = self.peers.peers.get(origin)
        if p is None:
            return True
        age = self.peers.clock() - p.record.heartbeat
        return self.peers.lease / 2 < age <= 2 * self.peers.lease

    def _holders(self) -> list[tuple[str, str]]:
        with self.peers.lock:
            return [(r.instance, r.address) for r in self.peers.serving()]

    def _look(self) -> None:
        with self.peers.lock:
            records = {i: p.record for i, p in self.peers.peers.items()}
        self.held.look(records, self.peers.clock(), self.peers.lease, lambda _: self.peers.kick())

    def start(self) -> None:
        if self.sender is not None:
            self.sender.start()

    def close(self) -> None:
        """At unmount, after the drain: nothing of this node's is unsaved any more, and what
        it holds for others goes with it (they copy to another node)."""
        if self.sender is not None:
            with self.oplog.lock:
                self.oplog.mirror = None
            self.sender.stop()
        self.held.close()

    def status(self) -> dict:
        return {"on": self.sender is not None, "sending": self.sender.status() if self.sender else None,
                **self.held.status()}
