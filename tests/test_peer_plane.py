"""The peer plane (``--peers-listen``) on the N-node fixture: nodes in mount namespaces over
one backing, talking over loopback (docs/design.md, "Nodes serve each other from RAM").

The readers reach the backing through faultfs views that count what they serve, as the
server of a network filesystem would see it: a file read from a peer's RAM costs the
backing no READ. Requests without the backing's secret, with another one, replayed, and
answers from a peer that lies are refused, and the readers fall back to the backing with
the right bytes."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from acpfs.cluster.auth import SECRET_NAME, Secret
from acpfs.cluster.plane import target_of, version_text
from acpfs.cluster.records import RecordName
from conftest import ACPFS, Node, wait_for, wait_gone

PEERS = ("--peers-listen", "127.0.0.1:0")
MIB = 1 << 20


class Cluster:
    """Nodes over one shared backing: ``direct`` nodes mount it as it is, ``viewed`` ones
    through a faultfs view each (``views[i]``), which counts what the backing serves them."""

    def __init__(self, faults, tmp_path: Path) -> None:
        self.faults, self.tmp = faults, tmp_path
        self.shared = tmp_path / "shared"
        self.shared.mkdir(exist_ok=True)
        self.mnt = tmp_path / "ckpt"
        self.mnt.mkdir(exist_ok=True)
        self.views: dict[str, object] = {}

    def node(self, name: str, view: bool, extra: tuple[str, ...] = PEERS) -> Node:
        backing = self.shared
        if view:
            (self.tmp / f"view-{name}").mkdir()
            shim = self.faults.shim(self.shared, self.tmp / f"view-{name}")
            self.views[name] = shim
            backing = shim.mnt
        node = Node(name, self.tmp, backing, self.mnt, extra=extra)
        self.faults.mounts.append(node)   # unmounted before the views, also when a test fails
        return node.mount()

    def backing_reads(self, name: str) -> int:
        time.sleep(0.35)   # faultfs writes its counts every 0.1 s
        return self.views[name].counts().get("read_bytes", 0)


def checkpoint(node: Node, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = node.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    node.sync()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plane(node: Node) -> dict:
    return node.status()["peer_plane"]


def known_peers(node: Node, n: int) -> None:
    wait_for(lambda: sum(1 for p in node.status()["peers"]["peers"]
                         if p["state"] != "left" and p["address"]) >= n,
             30, f"{node.name} sees {n} peer planes")


@pytest.fixture
def cluster(faults, tmp_path):
    return Cluster(faults, tmp_path)


def test_a_checkpoint_is_read_from_the_ram_of_the_node_that_wrote_it(cluster):
    """A writes and syncs a checkpoint; B and C, cold, read it: their bytes come from A's
    RAM (or B's), exact, and their backing views serve almost no READ. With A killed, B
    reads what only A held from the backing, exact."""
    rnd = random.Random(32)
    files = {f"step_100/shard{i}.bin": rnd.randbytes(12 * MIB + i * 4097) for i in range(3)}
    files["step_100/latest"] = b"step_100"
    a = cluster.node("a", view=False)
    checkpoint(a, files)
    assert plane(a)["on"] and plane(a)["address"].startswith("127.0.0.1:")
    b = cluster.node("b", view=True)
    c = cluster.node("c", view=True)
    c_instance = c.status()["peers"]["instance"]
    known_peers(b, 2)
    big = sum(len(d) for d in files.values() if len(d) >= MIB)
    before = cluster.backing_reads("b")
    for rel, data in files.items():
        assert sha(b.path(rel)) == hashlib.sha256(data).hexdigest(), rel
    read_b = cluster.backing_reads("b") - before
    pb = plane(b)
    assert pb["fetched_files"] == 3 and pb["fetched_bytes"] == big, pb
    assert read_b <= 64 * 1024, f"B's backing served {read_b} bytes of a {big}-byte checkpoint"
    assert plane(a)["served_bytes"] >= big // 2, plane(a)
    # C: from A or B (whoever holds it), again without the backing
    before = cluster.backing_reads("c")
    for rel, data in files.items():
        assert sha(c.path(rel)) == hashlib.sha256(data).hexdigest(), rel
    assert cluster.backing_reads("c") - before <= 64 * 1024
    assert plane(c)["fetched_bytes"] == big
    wait_for(lambda: plane(a)["served_bytes"] + plane(b)["served_bytes"] >= 2 * big, 10,
             "A and B count what they served (once each range is sent)")
    # read again: from the cache
    assert sha(b.path("step_100/shard0.bin")) == hashlib.sha256(files["step_100/shard0.bin"]).hexdigest()
    assert plane(b)["fetched_files"] == 3
    # A gone before its record expires, C unmounted: what only A held comes from the
    # backing, by B itself (the one node that answers)
    only_a = rnd.randbytes(6 * MIB)
    checkpoint(a, {"step_200/model.bin": only_a})
    addr_a = plane(a)["address"]
    os.kill(a.pid, signal.SIGKILL)
    assert wait_gone(a.pid, 30)
    c.run(*ACPFS, "umount", str(c.mnt))
    wait_for(lambda: not [p for p in b.status()["peers"]["peers"]
                          if p["instance"] == c_instance and p["state"] != "left"], 30, "C left")
    before = cluster.backing_reads("b")
    assert sha(b.path("step_200/model.bin")) == hashlib.sha256(only_a).hexdigest()
    assert cluster.backing_reads("b") - before >= len(only_a)
    pb = plane(b)
    assert pb["fetched_files"] == 3 and pb["pulled_files"] + pb["fallbacks"] == 1, pb
    assert addr_a in pb["failed_peers"], pb


def secret_of(backing: Path) -> Secret:
    key = (backing / ".acpfs-nodes" / SECRET_NAME.decode()).read_text()
    return Secret(bytes.fromhex(key), "0e57e57e57e5")


def ask(address: str, method: str, target: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    host, port = address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request(method, target, headers=headers)
    resp = c.getresponse()
    resp.body = resp.read()
    c.close()
    return resp


def test_requests_without_the_backing_secret_get_nothing(cluster, make_mount, tmp_path):
    """Only a request signed with the backing's own secret, once, gets bytes: none without
    a signature, with another secret (another backing's), sent again, or for another
    version. The secret is the owner's alone (0600) and never travels."""
    a = cluster.node("a", view=False)
    data = random.Random(1).randbytes(2 * MIB)
    checkpoint(a, {"x.bin": data})
    secret_file = cluster.shared / ".acpfs-nodes" / SECRET_NAME.decode()
    assert secret_file.stat().st_mode & 0o777 == 0o600
    st = os.stat(cluster.shared / "x.bin")
    version = (st.st_ino, st.st_size, st.st_mtime_ns)
    target, rng = target_of(b"x.bin", version), "bytes=0-1023"
    addr = plane(a)["address"]
    good = secret_of(cluster.shared)

    def signed(secret: Secret, method: str = "GET", tgt: str = target) -> tuple[dict, str]:
        auth, nonce = secret.sign(method, tgt, rng, addr)
        return {"Authorization": auth, "Range": rng}, nonce

    r = ask(addr, "GET", target, {"Range": rng})
    assert r.status == 401 and r.body == b""
    # another backing's mount: its own secret, which A does not take
    other = make_mount("other", extra=PEERS)
    other_secret = secret_of(other.back)
    assert other_secret.key != good.key
    r = ask(addr, "GET", target, signed(other_secret)[0])
    assert r.status == 401 and r.body == b""
    headers, nonce = signed(good)
    r = ask(addr, "GET", target, headers)
    assert r.status == 206 and r.body == data[:1024]
    vtext = version_text(version)
    good.believe(r.getheader("X-Acpfs-Mac"), nonce, 206, vtext, f"bytes 0-1023/{len(data)}")
    r = ask(addr, "GET", target, headers)   # the same request sent again
    assert r.status == 401 and r.body == b""
    stale = target_of(b"x.bin", (version[0], version[1], version[2] - 1))
    r = ask(addr, "GET", stale, signed(good, tgt=stale)[0])
    assert r.status == 404 and r.body == b""
    for bad in (b"../shared/x.bin", b".acpfs-nodes/.peer-secret", b"./x.bin", b"x.bin/.."):
        for method in ("HEAD", "GET"):   # signed, but no file of the mount: nothing
            tgt = target_of(bad, version, pull=method == "HEAD")
            r = ask(addr, method, tgt, signed(good, method, tgt)[0])
            assert r.status == 404 and r.body == b"", (bad, method, r.status)
    r = ask(addr, "GET", target, {"Authorization": headers["Authorization"].replace("mac=", "mac=0"),
                                  "Range": rng})
    assert r.status == 401
    assert plane(a)["refused_requests"] == 4
    text = a.log.read_text()
    assert "peer plane: refused GET" in text and "a request sent again" in text
    assert good.key.hex() not in text


class Liar(http.server.ThreadingHTTPServer):
    """A peer with the secret that lies about what it sends (``how``): another version,
    fewer bytes than it says, or an answer it does not sign."""

    def __init__(self, secret: Secret, how: str) -> None:
        self.secret, self.how = secret, how
        super().__init__(("127.0.0.1", 0), LiarHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class LiarHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Liar

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.answer(200, "")

    def do_GET(self) -> None:
        self.answer(206, self.headers["Range"])

    def answer(self, code: int, rng: str) -> None:
        s = self.server
        nonce = self.headers["Authorization"].split("nonce=")[1].split()[0]
        vtext = self.path.split("?v=")[1]
        ino, size, mtime = vtext.split(".")
        first, last = (int(x) for x in rng[6:].split("-")) if rng else (0, int(size) - 1)
        crange = f"bytes {first}-{last}/{size}" if rng else ""
        n = last + 1 - first
        if code == 206 and s.how == "version":
            vtext = f"{ino}.{size}.{int(mtime) + 1}"
        mac = s.secret.answer(nonce, code, vtext, crange)
        if code == 206 and s.how == "unsigned":
            mac = "0" * 64
        self.send_response(code)
        self.send_header("X-Acpfs-Version", vtext)
        self.send_header("X-Acpfs-Mac", mac)
        self.send_header("Content-Length", str(n))
        if rng:
            self.send_header("Content-Range", crange)
        self.end_headers()
        if code == 206:
            self.wfile.write(b"\xee" * (n // 2 if s.how == "short" else n))
            if s.how == "short":
                self.close_connection = True


@pytest.mark.parametrize("how", ["version", "short", "unsigned"])
def test_a_peer_that_lies_is_not_believed(cluster, how):
    """A peer with the secret that sends another version, a short body, or an unsigned
    answer: the reader takes none of its bytes, reads the backing, and says which peer."""
    a = cluster.node("a", view=False, extra=())   # no plane: the liar is the only holder
    data = random.Random(2).randbytes(3 * MIB)
    checkpoint(a, {"w.bin": data})
    liar = Liar(secret_of_soon(cluster.shared, a), how)
    where = f"127.0.0.1:{liar.server_address[1]}"
    now = time.time()
    record = RecordName("0bad0bad0bad", 1, now + 3600, now + 3600, "idle", "liar", where)
    (cluster.shared / ".acpfs-nodes" / record.encode().decode()).touch()
    b = cluster.node("b", view=True)
    known_peers(b, 1)
    before = cluster.backing_reads("b")
    assert sha(b.path("w.bin")) == hashlib.sha256(data).hexdigest()
    assert cluster.backing_reads("b") - before >= len(data)
    pb = plane(b)
    assert pb["fetched_files"] == 0 and pb["fallbacks"] == 1, pb
    why = {"version": "it serves version", "short": "the body ended after",
           "unsigned": "not signed with this backing's secret"}[how]
    assert why in pb["failed_peers"][where], pb
    liar.shutdown()


def secret_of_soon(backing: Path, node: Node) -> Secret:
    """The backing's secret: made by the first node with a plane; here none has one yet."""
    from acpfs.cluster.records import RecordsDir
    records = RecordsDir(str(backing))
    try:
        return Secret.load(records, "0e57e57e57e5")
    finally:
        records.close()


def test_nodes_loading_a_file_none_holds_read_the_backing_once(cluster):
    """A checkpoint written straight into the backing (by a node before a restart) that no
    node holds: three nodes load it at once; one of them (its leader) copies it from the
    backing, the others wait and copy it from that node's RAM. The backing serves its bytes
    once, not three times, and every node reads them exact."""
    data = random.Random(4).randbytes(24 * MIB + 11)
    (cluster.shared / "resume").mkdir()
    (cluster.shared / "resume" / "model.bin").write_bytes(data)
    nodes = [cluster.node(name, view=True, extra=PEERS + ("--peer-heartbeat", "1"))
             for name in ("b", "c", "d")]
    for node in nodes:
        known_peers(node, 2)
    before = {n.name: cluster.backing_reads(n.name) for n in nodes}
    readers = [n.popen("sha256sum", str(n.mnt / "resume" / "model.bin"), stdout=subprocess.PIPE,
                       text=True) for n in nodes]
    sums = {r.communicate(timeout=120)[0].split()[0] for r in readers}
    assert sums == {hashlib.sha256(data).hexdigest()}
    served = {n.name: cluster.backing_reads(n.name) - before[n.name] for n in nodes}
    planes = {n.name: plane(n) for n in nodes}
    assert sum(served.values()) <= 1.25 * len(data), (served, planes)
    assert sum(p["pulled_files"] for p in planes.values()) == 1, planes
    assert sum(p["fetched_files"] for p in planes.values()) == 2, planes
    assert sum(p["fallbacks"] for p in planes.values()) == 0, planes
    # the leader is the node whose backing served the file
    first = max(served, key=served.get)
    assert planes[first]["pulled_files"] == 1 and served[first] >= len(data)


def test_a_secret_others_can_read_leaves_the_plane_off(cluster):
    """A secret readable by other users is not used: the node mounts and serves files from
    the backing, its plane refuses everything, and status says why and what to do."""
    nodes_dir = cluster.shared / ".acpfs-nodes"
    nodes_dir.mkdir(mode=0o1777)
    nodes_dir.chmod(0o1777)
    secret = nodes_dir / SECRET_NAME.decode()
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o644)
    a = cluster.node("a", view=False)
    pa = plane(a)
    assert not pa["on"] and "readable by other users (mode 0644); make it 0600" in pa["why_not"], pa
    (a.path("f.bin")).write_bytes(b"x" * MIB)
    a.sync()
    st = os.stat(cluster.shared / "f.bin")
    target = target_of(b"f.bin", (st.st_ino, st.st_size, st.st_mtime_ns))
    auth, _ = Secret(bytes.fromhex(secret.read_text()), "0e57e57e57e5").sign("HEAD", target, "", pa["address"])
    assert ask(pa["address"], "HEAD", target, {"Authorization": auth}).status == 401
    text = a.run(*ACPFS, "status", str(a.mnt)).stdout
    assert f"peers      plane OFF at {pa['address']}: " in text
    assert "peer plane: off (" in a.log.read_text()
