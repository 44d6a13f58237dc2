"""The peer plane without mounts (acpfs/cluster/auth.py, plane.py, remote.py): the records'
address field, the secret and its signatures, and a plane serving a memory file to the
client over loopback, ranges and refusals checked byte for byte."""

from __future__ import annotations

import contextlib
import os
import random
import stat
import threading
import time

import pytest

from acpfs.cluster import auth
from acpfs.cluster.auth import SECRET_NAME, Refused, Secret
from acpfs.cluster.plane import Plane
from acpfs.cluster.records import RecordName, RecordsDir
from acpfs.cluster.remote import PeerError, Remote


def test_a_record_carries_its_plane_address():
    for address in ("10.0.0.7:7070", "[fe80::1]:9", "node-17.cluster.example.com:65535"):
        r = RecordName("0123456789ab", 3, 1795593897.5, 1795593898.25, "idle", "h:_ckpt", address)
        assert RecordName.parse(r.encode()) == r
    old = RecordName("0123456789ab", 3, 1.0, 2.0, "up", "host.a:_ckpt")   # a label with a dot
    assert RecordName.parse(old.encode()) == old and RecordName.parse(old.encode()).address == ""
    # the label gives way to a long address: the name stays a name
    long = RecordName("0123456789ab", 10**9, 1795593897.5, 1795593898.25, "up", "x" * 120, "h" * 55 + ":7070")
    name = long.encode()
    assert len(name) <= 255 and RecordName.parse(name).address == long.address
    assert RecordName.parse(b"0123456789ab.1.1.2.up.@zz.label").label == "@zz.label"


def test_signatures_prove_the_secret_once_for_one_server_within_the_window(monkeypatch):
    key = os.urandom(32)
    client, server = Secret(key, "0000000000aa"), Secret(key, "0000000000bb")
    me = "10.0.0.2:7070"
    header, nonce = client.sign("GET", "/v1/files/a?v=1.2.3", "bytes=0-9", me)
    assert server.check(header, "GET", "/v1/files/a?v=1.2.3", "bytes=0-9", me) == nonce
    with pytest.raises(Refused, match="used before"):
        server.check(header, "GET", "/v1/files/a?v=1.2.3", "bytes=0-9", me)
    # a request for one node is not taken by another (copied to it: another address)
    header, _ = client.sign("GET", "/v1/files/a?v=1.2.3", "bytes=0-9", me)
    with pytest.raises(Refused, match="a request for another node"):
        Secret(key, "0000000000cc").check(header, "GET", "/v1/files/a?v=1.2.3", "bytes=0-9",
                                          "10.0.0.3:7070")
    for method, target, rng in (("HEAD", "/v1/files/a?v=1.2.3", "bytes=0-9"),
                                ("GET", "/v1/files/b?v=1.2.3", "bytes=0-9"),
                                ("GET", "/v1/files/a?v=1.2.3", "bytes=0-10")):
        h, _ = client.sign("GET", "/v1/files/a?v=1.2.3", "bytes=0-9", me)
        with pytest.raises(Refused, match="wrong signature"):
            server.check(h, method, target, rng, me)
    other = Secret(os.urandom(32), "0000000000cc")
    with pytest.raises(Refused, match="another secret"):
        server.check(other.sign("GET", "/", "", me)[0], "GET", "/", "", me)
    for bad in (None, "", "Basic dXNlcjpwYXNz", "ACPFS1 node=x ts=1", "ACPFS1 ts=1 nonce=2 mac=\u00e9t\u00e9"):
        with pytest.raises(Refused):
            server.check(bad, "GET", "/", "", me)
    def signed_at(t: float) -> str:
        """A request ``client`` signs when its clock says ``t``."""
        monkeypatch.setattr(auth.time, "time", lambda: t)
        try:
            return client.sign("GET", "/", "", me)[0]
        finally:
            monkeypatch.undo()
    with pytest.raises(Refused, match="away from this node's clock"):
        server.check(signed_at(time.time() - auth.WINDOW - 5), "GET", "/", "", me)
    # signed before this server started (a node restarted at the same address): not taken
    with pytest.raises(Refused, match="before this daemon started"):
        server.check(signed_at(time.time() - auth.STARTED_SLACK - 5), "GET", "/", "", me)
    # nonces are forgotten once out of the window, whatever order they came in
    now = time.time()
    server.started = now - 10 * auth.WINDOW
    for t in (now - auth.WINDOW + 2, now - 5, now - auth.WINDOW + 1):
        server.check(signed_at(t), "GET", "/", "", me)
    assert len(server._seen) == 4
    monkeypatch.setattr(auth.time, "time", lambda: now + 3)
    server.check(client.sign("GET", "/", "", me)[0], "GET", "/", "", me)
    monkeypatch.undo()
    assert len(server._seen) == 3   # the two oldest went, the newest came
    mac = server.answer(nonce, 206, "1.2.3", "bytes 0-9/2")
    client.believe(mac, nonce, 206, "1.2.3", "bytes 0-9/2")
    for args in ((nonce, 206, "1.2.4", "bytes 0-9/2"), (nonce, 200, "1.2.3", "bytes 0-9/2"),
                 ("f" * 32, 206, "1.2.3", "bytes 0-9/2")):
        with pytest.raises(Refused, match="not signed"):
            client.believe(mac, *args)
    with pytest.raises(Refused):
        other.believe(mac, nonce, 206, "1.2.3", "bytes 0-9/2")
    with pytest.raises(Refused):
        client.believe("\u00e9" * 64, nonce, 206, "1.2.3", "bytes 0-9/2")


def test_the_secret_is_made_once_for_its_owner_alone(tmp_path):
    records = RecordsDir(str(tmp_path))
    records.ensure_dir()
    one = Secret.load(records, "0000000000aa")
    two = Secret.load(records, "0000000000bb")
    assert one.key == two.key and len(one.key) == 32
    path = tmp_path / ".acpfs-nodes" / SECRET_NAME.decode()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [SECRET_NAME.decode()]
    path.chmod(0o644)
    with pytest.raises(Refused, match=r"readable by other users \(mode 0644\); make it 0600"):
        Secret.load(records, "0000000000aa")
    path.chmod(0o600)
    path.write_text("not hex")
    with pytest.raises(Refused, match="not 64 hex digits"):
        Secret.load(records, "0000000000aa")
    path.unlink()
    path.symlink_to("/etc/hostname")
    with pytest.raises(OSError):
        Secret.load(records, "0000000000aa")
    records.close()


class MemHolder:
    """A holder of one file (a memory file), as core/peerreads.py holds cached ones."""

    def __init__(self, data: bytes, version: tuple[int, int, int]) -> None:
        self.fd = os.memfd_create("held")
        os.write(self.fd, data)
        self.version, self.size = version, len(data)
        self.held = 0
        self.pulls: list[bytes] = []
        self.copied, self.failed = len(data), False   # what a copy under way has so far

    def state(self, path: bytes, version, pull: bool):
        if self.hold(path, version) is not None:
            self.held -= 1
            return (200, self.size) if self.copied == self.size else (202, self.copied)
        if pull:
            self.pulls.append(path)
            return 202, 4096
        return 404, 0

    def hold(self, path: bytes, version):
        if path != b"dir/f.bin" or version != self.version:
            return None
        self.held += 1
        return "ref", self.size, self.ready

    def ready(self, end: int, wait: float = 0.0) -> bool | None:
        if end > self.copied and not self.failed and wait > 0:
            time.sleep(min(wait, 0.005))
        return True if end <= self.copied else None if self.failed else False

    @contextlib.contextmanager
    def runs(self, ref, size):
        piece = 1 << 20
        yield self.fd, iter([(off, off, min(piece, size - off)) for off in range(0, size, piece)])

    def let_go(self, ref) -> None:
        self.held -= 1


def test_a_plane_serves_exact_ranges_to_a_client_with_the_secret():
    data = random.Random(3).randbytes((5 << 20) + 12345)
    version = (77, len(data), 1795593897123456789)
    key = os.urandom(32)
    holder = MemHolder(data, version)
    plane = Plane("127.0.0.1:0", Secret(key, "0000000000aa"), holder)
    plane.start()
    try:
        remote = Remote(Secret(key, "0000000000bb"))
        assert remote.ask(plane.address, b"dir/f.bin", version) == ("held", len(data))
        assert remote.ask(plane.address, b"dir/f.bin", (77, len(data), 1)) == ("", 0)
        assert remote.ask(plane.address, b"dir/g.bin", version) == ("", 0)
        assert remote.ask(plane.address, b"dir/g.bin", version, pull=True) == ("pulling", 4096)
        assert holder.pulls == [b"dir/g.bin"]
        got = bytearray(len(data))

        def put(off: int, view: memoryview) -> None:
            got[off:off + len(view)] = view
        buf = memoryview(bytearray(1 << 16))
        for off, n in ((0, 1), (1, 3 << 20), ((3 << 20) + 1, len(data) - (3 << 20) - 1)):
            remote.get(plane.address, b"dir/f.bin", version, off, n, put, buf)
        assert got == data and holder.held == 0
        with pytest.raises(PeerError, match="answered 404"):
            remote.get(plane.address, b"dir/f.bin", (77, len(data), 1), 0, 10, put, buf)
        stranger = Remote(Secret(os.urandom(32), "0000000000cc"))
        with pytest.raises(PeerError, match="refused this node's signature"):
            stranger.ask(plane.address, b"dir/f.bin", version)
        want = {"served_bytes": len(data), "served_requests": 8, "refused_requests": 1}
        deadline = time.monotonic() + 5   # a request is counted once its bytes are sent
        while plane.status() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plane.status() == want
        remote.close()
    finally:
        plane.close()
    with pytest.raises(PeerError, match="ECONNREFUSED"):
        Remote(Secret(key, "0000000000bb")).ask(plane.address, b"dir/f.bin", version)


def test_a_plane_address_the_records_cannot_carry_refuses_in_one_line(monkeypatch):
    import acpfs.cluster.plane as plane_mod
    monkeypatch.setattr(plane_mod.socket, "gethostname", lambda: "n" * 70)
    with pytest.raises(RuntimeError, match=r"--peers-listen 0.0.0.0:0: the address the other "
                       r"nodes would reach, n{70}:\d+, is longer than 60 characters"):
        Plane("0.0.0.0:0", None, None)


def test_a_plane_address_in_use_refuses_in_one_line():
    first = Plane("127.0.0.1:0", None, None)
    try:
        with pytest.raises(RuntimeError, match=r"--peers-listen 127.0.0.1:\d+: cannot listen on "
                           r"127.0.0.1 port \d+: EADDRINUSE"):
            Plane(first.address, None, None)
    finally:
        first.close()


def test_a_file_being_copied_is_served_as_its_copy_grows():
    """A plane copying a file from the backing serves the prefix it has; a range past it
    waits for the copy (503 and again, while it grows), and fails once the copy does."""
    data = random.Random(4).randbytes(4 << 20)
    version = (78, len(data), 1795593897123456789)
    key = os.urandom(32)
    holder = MemHolder(data, version)
    holder.copied = 1 << 20
    plane = Plane("127.0.0.1:0", Secret(key, "0000000000aa"), holder)
    plane.start()
    try:
        remote = Remote(Secret(key, "0000000000bb"))
        assert remote.ask(plane.address, b"dir/f.bin", version) == ("pulling", 1 << 20)
        got = bytearray(len(data))

        def put(off: int, view: memoryview) -> None:
            got[off:off + len(view)] = view
        buf = memoryview(bytearray(1 << 16))

        def grow() -> None:
            time.sleep(2.5)   # past the plane's READY_WAIT: one 503 on the way
            holder.copied = len(data)
        threading.Thread(target=grow, daemon=True).start()
        start = time.monotonic()
        remote.get(plane.address, b"dir/f.bin", version, 0, 1 << 20, put, buf)
        assert time.monotonic() - start < 1.0   # the prefix at once
        remote.get(plane.address, b"dir/f.bin", version, 1 << 20, len(data) - (1 << 20), put, buf)
        assert time.monotonic() - start >= 2.4 and got == data
        holder.copied, holder.failed = 1 << 20, True
        with pytest.raises(PeerError, match="answered 404"):
            remote.get(plane.address, b"dir/f.bin", version, 2 << 20, 10, put, buf)
        remote.close()
    finally:
        plane.close()


def test_every_node_picks_the_same_leader_and_files_spread_over_the_nodes():
    from acpfs.core.peerreads import leader
    nodes = [f"10.0.0.{i}:7070" for i in range(1, 9)]
    picked = [leader(f"step_9/shard{i}.bin".encode(), (i, 1 << 30, 7), nodes) for i in range(400)]
    for i, first in enumerate(picked[:20]):   # the same whatever order a node lists them in
        shuffled = random.Random(i).sample(nodes, len(nodes))
        assert leader(f"step_9/shard{i}.bin".encode(), (i, 1 << 30, 7), shuffled) == first
    counts = {n: picked.count(n) for n in nodes}
    assert min(counts.values()) >= 25, counts   # 50 each on average
    # another version of a file may have another leader; a node gone moves only its files
    fewer = nodes[1:]
    moved = sum(1 for i, p in enumerate(picked)
                if p != nodes[0] and leader(f"step_9/shard{i}.bin".encode(), (i, 1 << 30, 7), fewer) != p)
    assert moved == 0
