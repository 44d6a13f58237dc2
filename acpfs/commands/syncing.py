"""What ``acpfs sync`` and ``acpfs umount`` wait for: this node's changes (``wait_durable``),
and with ``sync --all-nodes`` every live node's (``all_nodes``).

Every node over one backing keeps a record in ``<backing>/.acpfs-nodes`` with its *frontier*
(peers.py): everything the node acknowledged with a stamp before its frontier is in the
backing. ``all_nodes`` needs no new protocol, only those records, read by this node's daemon
(``status``'s ``peers``: each record's ``frontier``, when this node last ``listed`` it, and
``listed_at``, the start of the last complete listing). Why they are enough:

- Call time ``T``: this node's clock when the call starts.
- A change another node acknowledged before the call has a stamp of at most ``T``. The node
  answered it only once its own clock was ``skew`` past the stamp (the commit wait, while
  it had live peers: this node is one), and no two clocks differ by more than ``skew``
  (``--max-clock-skew``, the same bound global order relies on).
- So once a listing *started after* ``T`` shows the node's record with a frontier past
  ``T``, everything it acknowledged before the call is durable. A listing started after the
  call also shows every node that acknowledged anything before it: a node writes its record
  and then waits two heartbeats before it serves. And an idle node's record, whose frontier
  runs ahead of its clock (a promise), is renewed before any change under that promise is
  acknowledged (``Peers.announce``), so a listing after the call shows that renewal.
- This node's own changes are waited for by sequence number, like ``acpfs sync``.

A node whose record has not been renewed for a lease (dead, hung, cut off) holds nobody
back in global order and is not waited for here either; if its record does not show
everything before the call persisted, the call says so and fails: what that node
acknowledged is in its journal, not in the backing, until a daemon recovers it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from . import client
from ..config import format_size
from ..errors import Failure, UsageError
from ..config import age, safe
from ..daemon.health import held_text
from .progress import Progress, bar

POLL = 0.2   # seconds between two looks at the status while waiting for other nodes


def wait_durable(mountpoint: str, seq: int, timeout: float | None, label: str) -> None:
    """Block until the mount's flusher has applied ``seq``, showing progress."""
    prog = Progress()
    first: int | None = None   # applied_seq at the first status read

    def show(st: dict[str, Any]) -> None:
        nonlocal first
        applied = st["queue"]["applied_seq"]
        if first is None:
            first = applied
        err = st["errors"][0] if st["errors"] else None
        text = (f"{label}: {bar((applied - first) / max(1, seq - first))} "
                f"{seq - applied} operations left, {format_size(st['flushing']['bytes'])} queued, "
                f"{format_size(st['flush_rate_bytes_per_s'])}/s")
        if err:
            text += f"; retrying {safe(err['path'])}: {err['reason']}"
        held = (st.get("peers") or {}).get("held")
        if held and not err:
            text += f"; {held_text(held)}"
        prog.update(text)
    try:
        client.wait_applied(mountpoint, seq, timeout, show)
    except client.WaitTimeout as e:
        left = seq - e.status["queue"]["applied_seq"]
        err = e.status["errors"][0] if e.status["errors"] else None
        raise Failure(f"{label}: timed out after {timeout:g}s with {left} operations not yet "
                      f"persisted" + (f" ({safe(err['path'])}: {err['reason']})" if err else "")) from None
    finally:
        prog.done()


def wait_replicated(mountpoint: str, timeout: float | None, label: str) -> None:
    """Block until another node holds a copy of every change ``mountpoint`` acknowledged
    before the call (``--replicas 1``: ``status.replicas.sending``), showing progress."""
    sending = (client.read_status(mountpoint).get("replicas") or {}).get("sending")
    if not sending:
        raise Failure(f"{label}: this mount does not copy its changes to another node (mount "
                      f"it with --peers-listen and --replicas 1)")
    target = sending["position"]
    deadline = None if timeout is None else time.monotonic() + timeout
    prog = Progress()
    try:
        while True:
            s = client.read_status(mountpoint)["replicas"]["sending"]
            if s["acked"] >= target:
                return
            if s["holder"] is None and (s.get("error") or "").startswith("no live peer"):
                raise Failure(f"{label}: no other node with a peer plane is live to hold a copy")
            said = (f"{s['owed_records']} changes ({format_size(s['owed_bytes'])}) to copy to "
                    f"{s['holder'] or 'no node (none with a peer plane is live)'}"
                    + (f"; {safe(s['error'])}" if s.get("error") else ""))
            if deadline is not None and time.monotonic() > deadline:
                raise Failure(f"{label}: timed out after {timeout:g}s with {said}")
            prog.update(f"{label}: {said}")
            time.sleep(0.05)
    finally:
        prog.done()


class Others:
    """The other nodes over a mount's backing, as one status document shows them, measured
    against the call time ``called``."""

    def __init__(self, peers: dict[str, Any], called: float) -> None:
        self.fresh = peers["listed_at"] > called   # a listing started after the call
        self.error = peers.get("error")
        self.done: list[dict[str, Any]] = []       # persisted what they acknowledged before
        self.waiting: list[dict[str, Any]] = []    # live, not there yet
        self.lost: list[dict[str, Any]] = []       # expired, not there: not waited for
        for p in peers["peers"]:
            if p["state"] == "left" or (p["frontier"] > called and p["listed"] > called):
                self.done.append(p)   # "left": it persisted everything, then unmounted
            elif p["state"] == "expired":
                self.lost.append(p)
            else:
                self.waiting.append(p)

    def finished(self) -> bool:
        return self.fresh and not self.waiting

    def subject(self) -> str | None:
        """The daemon waited for first (None: a fresh listing)."""
        return self.waiting[0]["instance"] if self.fresh and self.waiting else None

    def progress(self, label: str, called: float) -> str:
        if not self.fresh:
            text = f"{label}: waiting for a listing of the node records"
            return text + (f" (they cannot be read: {self.error})" if self.error else "")
        first = self.waiting[0]
        behind = f"{max(0.0, called - first['frontier']):.1f}s behind the call"
        more = f" and {len(self.waiting) - 1} more" if len(self.waiting) > 1 else ""
        return (f"{label}: waiting for node {who(first, first['state'], behind)}{more}; "
                f"{len(self.done)} of "
                f"{len(self.done) + len(self.waiting) + len(self.lost)} other nodes done")


def all_nodes(mountpoint: str, deadline: float | None,
              read_status: Callable[[str], dict[str, Any]] = client.read_status,
              read_peers: Callable[[str], dict[str, Any]] = client.read_peers) -> int:
    """``sync --all-nodes`` for one mount: wait until this node and every live node over its
    backing have persisted what they acknowledged before the call; ``deadline``: a
    ``time.monotonic()`` to give up at (Failure). Returns how many other nodes were waited
    for. Fails, naming them, if expired nodes may hold changes acknowledged before the call."""
    called = time.time()
    label = f"sync --all-nodes {mountpoint}"
    doc = read_status(mountpoint)
    if doc.get("peers") is None:
        raise UsageError(f"sync --all-nodes: {mountpoint} is mounted with --global-order off: "
                         "this node keeps no record of the other nodes")
    wait_durable(mountpoint, doc["queue"]["last_seq"], left(deadline), f"{label}: this node")
    prog = Progress()
    subject = None   # what the progress line is about: a listing, or the node waited for
    try:
        while True:
            others = Others(read_peers(mountpoint), called)   # every record, paged
            if others.finished():
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise Failure(timed_out(label, others, called))
            now = others.subject()
            prog.update(others.progress(label, called), news=now != subject)
            subject = now
            time.sleep(POLL)
    finally:
        prog.done()
    if others.lost:
        raise Failure(lost(label, others.lost, called))
    return len(others.done)


def who(peer: dict[str, Any], *more: str) -> str:
    """A node as a person can find it: its label (host and mount point), its daemon, and
    ``more`` said of it."""
    return f"{safe(peer['node'])} ({', '.join(('daemon ' + peer['instance'],) + more)})"


def left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def timed_out(label: str, others: Others, called: float) -> str:
    if not others.fresh:
        return (f"{label}: timed out: the node records were not listed since the call"
                + (f" ({others.error})" if others.error else ""))
    names = ", ".join(who(p, f"{max(0.0, called - p['frontier']):.1f}s behind")
                      for p in others.waiting[:5])
    more = f" and {len(others.waiting) - 5} more" if len(others.waiting) > 5 else ""
    return (f"{label}: timed out waiting for {len(others.waiting)} nodes to persist what they "
            f"acknowledged before the call: {names}{more}")


def lost(label: str, nodes: list[dict[str, Any]], called: float) -> str:
    names = ", ".join(who(p, f"last heartbeat {age(p['last_heartbeat'])} ago") for p in nodes[:5])
    return (f"{label}: {len(nodes)} nodes stopped renewing their records (dead, hung or cut off "
            f"from the backing) before they persisted everything: {names}; what they "
            f"acknowledged is not in the backing until a daemon recovers their journal")
