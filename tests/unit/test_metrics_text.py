"""The Prometheus text (acpfs/metrics.py) of real status documents, read back with the
Prometheus client's parser: label values that need escaping, several mounts and a stale one
in one text, the histogram's buckets. The ``--metrics`` addresses, the endpoint's answers
and its bound on the scrapes it serves at once (acpfs/metrics_http.py). The alert rules of
docs/operations.md, which may only name metrics acpfs exports."""

from __future__ import annotations

import dataclasses
import http.client
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from acpfs.core import control
from acpfs.daemon import health, metrics
from acpfs.config import CLOSE_TO_DURABLE_BUCKETS, METRICS_MAX_SCRAPES
from acpfs.errors import UsageError
from acpfs.flusher.histogram import Histogram
from acpfs.config import parse_address
from acpfs.daemon.metrics_http import Endpoint, Unavailable
from triocore import close, create, drain, mount_info, run, write

DOCS = Path(__file__).resolve().parents[2] / "docs"
ODD = 'a "quoted"\\back\\slash\nand a newline'


def families(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"{fam.name} twice"
        out[fam.name] = fam.samples
    return out


def test_render_escapes_labels_and_joins_mounts(core):
    """Two live mounts (one with a name that needs escaping) and a stale one: one HELP/TYPE
    per family, every series labelled with its mount point, exactly as written."""
    async def one_file(c) -> None:
        fh, _ = await create(c, b"f")
        await write(c, fh, b"x" * 70_000)
        await close(c, fh)
        await drain(core)
    run(core, one_file)
    info = mount_info(core)
    docs = [control.status(core.flusher, info),
            control.status(core.flusher, dataclasses.replace(info, opts=dataclasses.replace(info.opts, mountpoint=ODD))),
            {"mountpoint": "/gone", "stale": True}]
    text = metrics.render(docs)
    assert text.count("# TYPE acpfs_up gauge") == 1
    got = families(text)
    ups = {s.labels["mountpoint"]: s.value for s in got["acpfs_up"]}
    assert ups == {info.opts.mountpoint: 1, ODD: 1, "/gone": 0}
    persisted = {s.labels["mountpoint"]: s.value for s in got["acpfs_persisted_bytes"]}
    assert persisted == {info.opts.mountpoint: 70_000, ODD: 70_000}
    buckets = [s for s in got["acpfs_close_to_durable_seconds"]
               if s.name.endswith("_bucket") and s.labels["mountpoint"] == ODD]
    assert [s.labels["le"] for s in buckets] == \
        [metrics.number(b) for b in CLOSE_TO_DURABLE_BUCKETS] + ["+Inf"]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == 1
    kinds = {s.labels["kind"] for s in got["acpfs_conflicts"] if s.labels["mountpoint"] == ODD}
    assert "replaced" in kinds
    assert metrics.render([]) == ""


def test_a_document_of_an_older_daemon_leaves_out_what_it_lacks(core):
    """``status --prometheus`` reads every mount on the host, some perhaps served by an older
    daemon: a key its document lacks leaves that series out, never a made-up 0."""
    doc = control.status(core.flusher, mount_info(core))
    for key in ("errors_since_mount", "write_through", "close_to_durable_s"):
        del doc[key]
    got = families(metrics.render([doc]))
    assert "acpfs_retries" not in got and "acpfs_close_to_durable_seconds" not in got
    assert "acpfs_gc_collections" not in got   # the harness has no collector: {"on": False}
    assert got["acpfs_persisted_files"][0].value == 0


def test_a_node_held_back_by_a_peer_is_not_healthy(core):
    """Global order: the other nodes by state, and a peer holding this node's queue, which
    ``status --check`` calls degraded."""
    doc = control.status(core.flusher, mount_info(core))
    doc["peers"] = {"held": {"op": "publish", "path": "latest", "since": time.time() - 5,
                             "waiting_for": "node2:/ckpt", "instance": "ab12"},
                    "peers": [{"node": "node2:/ckpt", "state": "up"},
                              {"node": "node3:/ckpt", "state": "up"},
                              {"node": "node4:/ckpt", "state": "expired"}]}
    got = families(metrics.render([doc]))
    assert {s.labels["state"]: s.value for s in got["acpfs_peers"]} == \
        {"up": 2, "idle": 0, "expired": 1, "left": 0}
    assert got["acpfs_peer_holding"][0].value == 1
    assert got["acpfs_peer_holding_seconds"][0].value >= 5
    assert got["acpfs_healthy"][0].value == 0
    doc["peers"]["held"] = None
    got = families(metrics.render([doc]))
    assert got["acpfs_peer_holding_seconds"][0].value == 0 and got["acpfs_healthy"][0].value == 1


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0, -1.0):
        h.observe(v)
    d = h.as_dict()
    assert d["buckets"] == [[0.1, 3], [1.0, 4]] and d["count"] == 5
    assert d["sum"] == pytest.approx(7.65)


@pytest.mark.parametrize("text, address", [
    ("9710", ("127.0.0.1", 9710)), (":9710", ("127.0.0.1", 9710)), ("0", ("127.0.0.1", 0)),
    ("0.0.0.0:9710", ("0.0.0.0", 9710)), ("node-1.example:80", ("node-1.example", 80)),
    ("[::1]:9710", ("::1", 9710)), ("[::]:1", ("::", 1)),
])
def test_metrics_addresses(text, address):
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["", "nine", ":", "::1:9710", "70000", "host:", "a b:1",
                                  "[1.2.3.4]:5", "-host:5", "host:-1"])
def test_bad_metrics_addresses(text):
    with pytest.raises(UsageError) as e:
        parse_address(text)
    assert "\n" not in str(e.value) and "--metrics" in str(e.value)


def test_alert_rules_in_the_docs_name_exported_metrics():
    """The rules of docs/operations.md ("Monitoring") use only families acpfs exports (a
    counter by its ``_total`` name, a histogram by its family name or a series of it)."""
    page = (DOCS / "operations.md").read_text()
    rules = re.search(r"```yaml\ngroups:.*?```", page, re.S)
    assert rules, "no alert rules in docs/operations.md"
    used = set(re.findall(r"\bacpfs_\w+", rules.group(0)))
    assert {"acpfs_oldest_unsaved_seconds", "acpfs_publish_errors_total", "acpfs_up",
            "acpfs_peer_holding_seconds"} <= used
    for name in used:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in metrics.FAMILIES or base in metrics.FAMILIES, name
    table = set(re.findall(r"`(acpfs_\w+)", page))
    assert set(metrics.FAMILIES) <= table, set(metrics.FAMILIES) - table


def get(address: str, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_endpoint_answers_and_bounds_the_scrapes_it_serves_at_once():
    """200 with the text, 404 elsewhere, 503 while the daemon has nothing to render; idle
    connections hold at most METRICS_MAX_SCRAPES threads: one more is closed unanswered,
    and scrapes are served again once they go."""
    ready = []

    def render() -> str:
        if not ready:
            raise Unavailable("acpfs is starting")
        return "acpfs_up 1\n"
    ep = Endpoint(":0", render)
    ep.start()
    try:
        assert ep.address.startswith("127.0.0.1:")
        assert get(ep.address) == (503, "acpfs is starting\n")
        ready.append(True)
        assert get(ep.address) == (200, "acpfs_up 1\n")
        assert get(ep.address, "/")[0] == 404
        host, port = ep.address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(METRICS_MAX_SCRAPES)]
        try:
            with socket.create_connection((host, int(port)), timeout=5) as extra:
                try:
                    assert extra.recv(100) == b""          # closed, nothing said
                except ConnectionResetError:
                    pass
        finally:
            for c in idle:
                c.close()
        def scrape() -> tuple[int, str]:
            """A scrape, or (0, "") for one closed unanswered: the threads of the idle
            connections just closed may not have seen them go yet (they are then all busy)."""
            try:
                return get(ep.address)
            except (http.client.RemoteDisconnected, ConnectionResetError):
                return 0, ""
        deadline = time.monotonic() + 5
        while (got := scrape())[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == (200, "acpfs_up 1\n")
    finally:
        ep.close()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2)
    assert f"at most {METRICS_MAX_SCRAPES} are served at once" in \
        (DOCS / "operations.md").read_text().replace("\n", " ")


def test_the_cycle_collector_is_exported_by_generation(core):
    """``collector`` of the status document (daemon/collector.py) as three families, young
    and full apart."""
    from acpfs.daemon.collector import Collector
    doc = control.status(core.flusher, mount_info(core))
    col = Collector(lambda: 0)
    col.full, col.full_s, col.longest_full_s = 3, 0.5, 0.3
    col.young, col.young_s, col.longest_young_s = 40, 0.1, 0.004
    doc["collector"] = col.status()
    got = families(metrics.render([doc]))
    by_gen = {f: {s.labels["generation"]: s.value for s in got[f]}
              for f in ("acpfs_gc_collections", "acpfs_gc_seconds", "acpfs_gc_longest_seconds")}
    assert by_gen == {"acpfs_gc_collections": {"young": 40, "full": 3},
                      "acpfs_gc_seconds": {"young": 0.1, "full": 0.5},
                      "acpfs_gc_longest_seconds": {"young": 0.004, "full": 0.3}}


def test_idle_polling_is_exported_where_it_is_on(core):
    """``idle_poll`` of the status document (--idle-poll) as two counters, and none where it
    is off (an unprivileged daemon: nothing was ever held)."""
    doc = control.status(core.flusher, mount_info(core))
    assert doc["idle_poll"] == {"on": False, "why_not": "not asked for"}
    assert not {"acpfs_idle_poll_holds", "acpfs_idle_poll_held_seconds"} & \
        set(families(metrics.render([doc])))
    doc["idle_poll"] = {"on": True, "held": False, "holds": 7, "held_s": 1.25, "tail_ms": 50,
                        "errors": 0}
    got = families(metrics.render([doc]))
    assert [s.value for s in got["acpfs_idle_poll_holds"]] == [7]
    assert [s.value for s in got["acpfs_idle_poll_held_seconds"]] == [1.25]


def test_the_peer_plane_is_exported_where_it_is_on(core):
    """``peer_plane`` of the status document (--peers-listen) as five counters and a gauge
    of the peers that failed, and none where it is off."""
    doc = control.status(core.flusher, mount_info(core))
    assert doc["peer_plane"] == {"on": False, "why_not": "not asked for (--peers-listen)"}
    assert not {f for f in families(metrics.render([doc])) if f.startswith("acpfs_peer_")}
    doc["peer_plane"] = {"on": True, "why_not": None, "address": "n1:7070", "asked": 4,
                         "fetched_files": 3, "fetched_bytes": 3 << 30, "fallbacks": 1,
                         "served_bytes": 5 << 30, "served_requests": 400, "refused_requests": 2,
                         "failed_peers": {"n2:7070": "12:00:00 peer n2:7070: refused"}}
    got = {f: [s.value for s in v] for f, v in families(metrics.render([doc])).items()
           if f.startswith("acpfs_peer_")}
    assert got == {"acpfs_peer_fetched_bytes": [3 << 30], "acpfs_peer_fetched_files": [3],
                   "acpfs_peer_fallbacks": [1], "acpfs_peer_served_bytes": [5 << 30],
                   "acpfs_peer_refused_requests": [2], "acpfs_peer_failed_peers": [1]}


def test_replicas_are_exported_and_owed_changes_past_the_bound_are_not_healthy(core):
    """``replicas`` of the status document: what this node copies (--replicas 1) and holds
    for others; changes not copied for longer than the bound, or a takeover that failed,
    make the mount degraded (``status --check``, ``acpfs_healthy``)."""
    doc = control.status(core.flusher, mount_info(core))
    assert doc["replicas"] == {"on": False}
    assert not {f for f in families(metrics.render([doc])) if f.startswith("acpfs_replica_")}
    sending = {"holder": "n2:7070", "holder_instance": "ab12", "owed_records": 2,
               "owed_bytes": 3 << 20, "owed_age_s": 1.0, "sent_bytes": 7 << 30, "failures": 0,
               "error": None}
    doc["replicas"] = {"on": True, "sending": sending, "held": {"cd34": {"bytes": 5 << 20}},
                       "held_bytes": 5 << 20, "budget": 1 << 30, "received_bytes": 9 << 20,
                       "refused_batches": 0, "takeovers": {"ef56": {"state": "done"}}}
    got = families(metrics.render([doc]))
    assert {f: [s.value for s in v] for f, v in got.items() if f.startswith("acpfs_replica_")} == \
        {"acpfs_replica_owed_bytes": [3 << 20], "acpfs_replica_sent_bytes": [7 << 30],
         "acpfs_replica_held_bytes": [5 << 20], "acpfs_replica_received_bytes": [9 << 20],
         "acpfs_replica_takeovers": [1]}
    assert got["acpfs_healthy"][0].value == 1
    code, why = health.health(doc, None)
    assert code == health.HEALTHY, why
    sending.update(owed_age_s=health.REPLICAS_OWED_S + 1, error="n2:7070: the replica budget is full")
    code, why = health.health(doc, None)
    assert code == health.DEGRADED and "not copied to another node" in why[0] and "budget" in why[0]
    sending.update(owed_age_s=0.0)
    doc["replicas"]["takeovers"]["ef56"] = {"state": "failed", "said": "acpfs: cannot recover"}
    code, why = health.health(doc, None)
    assert code == health.DEGRADED and "ef56" in why[0], why
