"""The control attributes (acpfs/control.py) on a core without a mount: the listing of
pending files, read page by page, for 100,000 files (none may be missing: one attribute value
is at most 64 KiB; the listing used to be cut at 400 files, and failed with E2BIG before
that with long paths)."""

from __future__ import annotations

import errno
import json
import time

import pytest

from acpfs.commands import client, syncing
from acpfs.core import control
from acpfs.errors import Failure
from acpfs.core.control import FILES
from acpfs.node import node_path
from harness import write_file
from triocore import mount_info


def read_all(core, trusted=True):
    get = lambda name: control.get(core.flusher, None, core.cache.inodes.root, name, trusted)  # noqa: E731
    raw = get(FILES)
    pages = [raw]
    page = json.loads(raw)
    files = list(page["files"])
    while page["next"]:
        raw = get(page["next"].encode())
        pages.append(raw)
        page = json.loads(raw)
        files.extend(page["files"])
    return files, pages


def test_a_listing_of_100000_pending_files_comes_in_pages_under_64_kib(core):
    cache = core.cache
    dirs = [cache.names.mkdir(cache.inodes.root, b"dir-%03d-" % i + b"d" * 240, 0o755, 0, 0) for i in range(100)]
    names = set()
    for i in range(100_000):
        node = cache.names.create(dirs[i % 100], b"file-%06d-" % i + b"f" * 200, 0o644, 0, 0)
        cache.files.open(node, True, False)                 # open for writing: dirty
        names.add(node_path(node))
    files, pages = read_all(core)
    assert max(len(p) for p in pages) <= 65536 and len(pages) > 300
    paths = [f["path"] for f in files]
    assert len(paths) == 100_000 and set(paths) == names and paths == sorted(paths)
    assert all(f["state"] == "dirty" for f in files)
    assert json.loads(pages[0])["total"] == 100_000


def test_the_pages_of_one_listing_agree_while_the_mount_changes(core):
    cache = core.cache
    for i in range(3000):
        node = cache.names.create(cache.inodes.root, b"f%05d-" % i + b"x" * 100, 0o644, 0, 0)
        cache.files.open(node, True, False)
    get = lambda name: control.get(core.flusher, None, cache.inodes.root, name)   # noqa: E731
    first = json.loads(get(FILES))
    for i in range(500):                              # more files between two pages
        node = cache.names.create(cache.inodes.root, b"a%05d" % i, 0o644, 0, 0)
        cache.files.open(node, True, False)
    files, page = list(first["files"]), first
    while page["next"]:
        page = json.loads(get(page["next"].encode()))
        files.extend(page["files"])
    assert len(files) == 3000 and len({f["path"] for f in files}) == 3000
    assert len(read_all(core)[0]) == 3500            # a new listing sees them


def test_a_gone_listing_says_so_and_other_users_get_no_page(core):
    cache = core.cache
    node = cache.names.create(cache.inodes.root, b"f", 0o644, 0, 0)
    cache.files.open(node, True, False)
    with pytest.raises(OSError) as e:
        control.get(core.flusher, None, cache.inodes.root, FILES + b".0badcafe.10")
    assert e.value.errno == errno.EAGAIN
    one = json.loads(control.get(core.flusher, None, cache.inodes.root, FILES))
    for name in (FILES, FILES + b".00000000.0"):
        with pytest.raises(OSError) as e:
            control.get(core.flusher, None, cache.inodes.root, name, trusted=False)
        assert e.value.errno == errno.EACCES
    assert one["total"] == 1 and one["next"] is None
    for _ in range(control.Listings.MAX + 2):         # only the newest few are kept
        control.get(core.flusher, None, cache.inodes.root, FILES)
    assert len(control.listings._kept) <= control.Listings.MAX


def test_the_status_document_fits_one_attribute_whatever_was_kept_aside_or_shares_the_backing(core):
    """A recovery that kept 5,000 files aside, and 2,000 other nodes over the backing: the
    status stays under 64 KiB (it failed with E2BIG, and with it ``acpfs status``, ``sync``
    and ``umount``): the first 20 paths of each list with their totals; as many node
    records as fit, with ``peers_total``."""
    paths = [f".acpfs-recovered/20261128-aa/step_{i:05d}%2Fshard-{i:05d}.bin" for i in range(5000)]
    info = mount_info(core)
    info.recovery = {"started": 1.0, "replayed_ops": 5000, "files": 5000, "skipped": 0,
                          "lost_open_files": paths[:3000], "kept_aside": paths}
    info.recovery_aside = {p: 10 ** 9 for p in paths}      # none applied yet
    raw = control.get(core.flusher, info, core.cache.inodes.root, control.STATUS)
    rec = json.loads(raw)["recovery"]
    assert len(raw) <= 65536
    assert rec["kept_aside"] == paths[:20] and rec["kept_aside_total"] == 5000
    assert rec["lost_open_files"] == paths[:20] and rec["lost_open_files_total"] == 3000
    assert rec["aside_pending"] == paths[:20] and rec["aside_pending_total"] == 5000
    doc = control.status(core.flusher, info)
    peers = [{"node": f"node-{i:04d}.cluster.example:/ckpt", "instance": f"{i:012x}",
              "state": "idle", "frontier_lag": 0.0, "last_heartbeat": 0.5,
              "frontier": 1e9, "listed": 1e9} for i in range(2000)]
    doc["peers"] = {"instance": "x", "node": "self", "peers": peers, "held": None}
    raw = control.fitted(doc)
    pe = json.loads(raw)["peers"]
    assert len(raw) <= 65536 and pe["peers_total"] == 2000
    assert 0 < len(pe["peers"]) < 2000 and pe["peers"] == peers[:len(pe["peers"])]
    doc["peers"]["peers"] = peers[:10]                       # what fits stays whole
    assert "peers_total" not in json.loads(control.fitted(doc))["peers"]


def test_every_node_record_is_read_page_by_page_and_sync_all_nodes_waits_for_all(core, monkeypatch):
    """2,000 other nodes over the backing: the status lists the records that fit, and
    ``user.acpfs.peers`` gives every one, page by page, each page under 64 KiB; ``acpfs sync
    --all-nodes`` reads them all, so it waits for the last node too (it refused before)."""
    called = time.time()
    records = [{"node": f"node-{i:04d}.cluster.example:/ckpt", "instance": f"{i:012x}",
                "state": "up", "frontier_lag": 0.0, "last_heartbeat": 0.5,
                "frontier": called + 5, "listed": called + 5} for i in range(2000)]
    records[1999]["frontier"] = called - 1                    # the last node is behind
    pages = []

    class Order:   # global order's status as the flusher shows it (the queue is empty)
        held = None

        def status(self):
            return {"instance": "me", "node": "self", "skew": 0.5, "heartbeat": 1.0,
                    "lease": 30.0, "ops": 0, "error": None, "held": None,
                    "peers": [dict(r) for r in records], "listed_at": called + 5}
    monkeypatch.setattr(core.flusher, "order", Order())
    info = mount_info(core)

    def getxattr(path, name, failed, stale=None):
        raw = control.get(core.flusher, info, core.cache.inodes.root, name)
        pages.append(len(raw))
        return raw
    monkeypatch.setattr(client, "_getxattr", getxattr)
    status = client.read_status("/m")
    assert status["peers"]["peers_total"] == 2000 and len(status["peers"]["peers"]) < 2000
    pages.clear()
    got = client.read_peers("/m")
    assert got["peers"] == records and got["listed_at"] == called + 5 and got["lease"] == 30.0
    assert len(pages) > 5 and max(pages) <= 65536
    with pytest.raises(Failure, match="node-1999.cluster.example:/ckpt"):
        syncing.all_nodes("/m", time.monotonic() + 0.5)       # waits for the last one
    records[1999]["frontier"] = called + 5
    assert syncing.all_nodes("/m", time.monotonic() + 5) == 2000


def test_the_progress_document_says_what_the_status_says_of_a_wait(core):
    """``user.acpfs.progress`` (what ``acpfs sync`` polls): the status's values of the keys
    a wait shows, a failing op at the head included; other users get no file names."""
    cache, back = core.cache, core.backing
    back.inject("publish", errno=errno.EIO)      # the head fails, and keeps its place
    for i in range(30):
        node = write_file(cache, b"f%02d" % i, b"x" * (1000 + i))
        cache.files.release(node, True)
    deadline = time.monotonic() + 10
    while not (core.oplog.queue and core.oplog.queue[0].error):
        assert time.monotonic() < deadline, "the publish never failed"
        time.sleep(0.01)
    info = mount_info(core)
    root = cache.inodes.root
    with core.oplog.lock:   # nothing moves between the two reads
        st = json.loads(control.get(core.flusher, info, root, control.STATUS))
        pr = json.loads(control.get(core.flusher, info, root, control.PROGRESS))
    assert pr["queue"] == st["queue"] and pr["queue"]["pending_ops"] == 30
    assert pr["flushing"]["bytes"] == st["flushing"]["bytes"] == sum(1000 + i for i in range(30))
    # the time to the next retry is counted from each read: the same but for the moment read
    waits = [e.pop("next_retry_in_s") for e in pr["errors"]], [e.pop("next_retry_in_s") for e in st["errors"]]
    assert all(abs(a - b) <= 0.2 for a, b in zip(*waits)) and len(waits[0]) == len(waits[1])
    assert pr["errors"] == st["errors"] and pr["errors"][0]["path"] == "f00"
    assert pr["flush_rate_bytes_per_s"] == st["flush_rate_bytes_per_s"]
    assert pr["peers"] is None and st["peers"] is None   # global order off here
    hidden = json.loads(control.get(core.flusher, info, root, control.PROGRESS, trusted=False))
    assert hidden["errors"][0]["path"] == control.HIDDEN
    back.clear()
    core.drain()
    pr = json.loads(control.get(core.flusher, info, root, control.PROGRESS))
    assert pr["queue"]["applied_seq"] == pr["queue"]["last_seq"] and pr["errors"] == []
    assert pr["flush_rate_bytes_per_s"] == round(sum(1000 + i for i in range(30)) / 10)
