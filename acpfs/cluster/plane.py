"""The peer plane's server (``acpfs mount --peers-listen HOST:PORT``): this node serves the
files its cache holds to the other nodes of its backing (docs/design.md, "Nodes serve each
other from RAM").

The protocol is HTTP/1.1, which every operator can read with curl and tcpdump:

- ``HEAD /v1/files/<path>?v=<ino>.<size>.<mtime_ns>[&pull=1]``: 200 when this node holds
  the file at ``<path>`` (relative to the backing, percent-encoded) in that version of the
  backing (the inode, size and mtime the client's open revalidated), clean; 202 while it
  copies that version from the backing for the job (``X-Acpfs-Progress``: bytes so far),
  which ``pull=1`` asks it to start; else 404.
- ``GET`` of the same with ``Range: bytes=A-B``: 206 and those bytes, sent with
  ``sendfile`` from the memory file (or the pool) that holds them, no copy through Python.
  While the file is copied from the backing, a range of the prefix already copied is
  served at once, a later one once the copy reaches it; 503 if it does not within
  ``READY_WAIT`` (the client asks again).

Every request must be signed (``auth.Secret.check``); one that is not gets 401 and no body,
and the connection is closed. Every answer is signed back, over the version it serves and
its range (``X-Acpfs-Mac``), and says the version (``X-Acpfs-Version``).

What is served is the holder's business (``Holder``, core/peerreads.py): ``hold`` finds the
file and takes a reference to its bytes as they are (a writer that opens it later writes a
copy: ``Store.share``), on the FUSE loop's thread; ``runs`` gives the descriptor and the
runs of it that hold the bytes; ``let_go`` gives the reference back.

Owns the listening socket, bound when the daemon starts (a port in use refuses the mount in
one line, as ``--metrics`` does), the address the node records carry (``address``: the bound
address, or the host name where it binds every address), and the threads that serve, one
per connection, at most ``MAX_CONNECTIONS`` (a connection beyond them is closed
unanswered). Counters (``served_bytes``, ``requests``, ``refused``) are guarded by ``_lock``.
"""

from __future__ import annotations

import http.server
import logging
import math
import socket
import socketserver
import sys
import threading
import urllib.parse
import time
from typing import Any, Callable, ContextManager, Iterator, Protocol

from ..backing.retry import describe
from .auth import Refused, Secret
from .records import ADDRESS_MAX

log = logging.getLogger(__name__)

PREFIX = "/v1/files/"
REPLICAS = "/v1/replicas/"   # POST: a batch of another node's journal (replicas.py)
MAX_CONNECTIONS = 64
CLIENT_TIMEOUT = 30.0   # s a connection may stay silent
READY_WAIT = 2.0        # s a GET waits for a copy under way to reach its range, then 503
CLOSE_WAIT = 10.0       # s the unmount waits for the requests being served
Version = tuple[int, int, int]   # (inode, size, mtime_ns) in the backing


class Holder(Protocol):
    def state(self, path: bytes, version: Version, pull: bool) -> tuple[int, int]:
        """(200, size) held, (202, bytes so far) being copied from the backing (``pull``:
        start that), or (404, 0)."""
    def hold(self, path: bytes, version: Version) -> tuple[Any, int, Callable[[int], bool | None]] | None:
        """(a reference to the bytes, the size, ``ready``) of the file at ``path`` in
        ``version``, clean, or being copied from the backing; None where this node does not
        hold it so. ``ready(end, wait)``: whether the bytes up to ``end`` are there, waiting
        up to ``wait`` s for them (None: they never will be: the copy failed)."""
    def runs(self, ref: Any, size: int) -> ContextManager[tuple[int, Iterator[tuple[int, int, int]]]]:
        """A descriptor and its runs (file offset, offset in the descriptor, length)."""
    def let_go(self, ref: Any) -> None: ...


def version_text(v: Version) -> str:
    return "%d.%d.%d" % v


def parse_version(text: str) -> Version | None:
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def target_of(path: bytes, version: Version, pull: bool = False) -> str:
    """The request target for ``path`` (relative to the backing) in ``version``."""
    return PREFIX + urllib.parse.quote(path, safe="/") + "?v=" + version_text(version) \
        + ("&pull=1" if pull else "")


def parse_address(text: str, what: str = "--peers-listen") -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` or ``[IPV6]:PORT``; ValueError with one line."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"invalid {what} {text!r}: use HOST:PORT or [IPV6]:PORT, the port a "
                         "number from 0 to 65535 (0: any free port)")
    return host, int(port)


class Plane:
    """The bound socket of the peer plane and its serving thread (``start``, ``close``)."""

    def __init__(self, text: str, secret: Secret | None, holder: Holder | None) -> None:
        host, port = parse_address(text)
        self.server = listening(f"--peers-listen {text}", host, port,
                                lambda family, address: Server(family, address, self))
        bound = self.server.server_address
        # where the others reach it: the host as bound, or this host's name where every
        # address is bound (0.0.0.0, ::)
        name = socket.gethostname() if bound[0] in ("0.0.0.0", "::") else bound[0]
        self.address = f"[{name}]:{bound[1]}" if ":" in name else f"{name}:{bound[1]}"
        if len(self.address) > ADDRESS_MAX:   # the records carry it (names of 255 bytes)
            self.server.server_close()
            raise RuntimeError(f"--peers-listen {text}: the address the other nodes would "
                               f"reach, {self.address}, is longer than {ADDRESS_MAX} characters; "
                               "give a shorter host name or the address itself")
        self.secret = secret    # None: it refuses everything (no secret usable: why_not)
        self.holder = holder    # None until the FUSE loop runs: 404 meanwhile
        self.replicas: Any = None   # replicas.Replicas: what it holds for others (POST)
        self._lock = threading.Lock()
        self.served_bytes = 0
        self.requests = 0
        self.refused = 0
        self._warned: dict[str, float] = {}   # client -> when its refusal was last a WARNING
        self.thread = threading.Thread(target=self.server.serve_forever, name="acpfs-plane",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()
        log.info("peer plane: serving the files of this cache to the other nodes at %s",
                 self.address)

    def close(self) -> None:
        """Stop serving, before the store closes: no request finds a file any more, the
        connections being served are shut, and their threads (each holding a reference to
        bytes of the store until its ``let_go``) are waited for."""
        self.holder = None
        if not self.thread.is_alive():
            self.server.server_close()
        elif not self.server.stop(CLOSE_WAIT):
            log.warning("peer plane: requests still served %.0f s after the unmount; closing "
                        "the cache under them", CLOSE_WAIT)

    def status(self) -> dict:
        with self._lock:
            return {"served_bytes": self.served_bytes, "served_requests": self.requests,
                    "refused_requests": self.refused}

    def refusal_level(self, client: str) -> int:
        """WARNING for a client's first refusal in a minute, DEBUG for the rest (a flood of
        bad requests does not flood the log)."""
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get(client, -math.inf) < 60:
                return logging.DEBUG
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned[client] = now
        return logging.WARNING

    def count(self, served: int = 0, refused: bool = False) -> None:
        with self._lock:
            self.served_bytes += served
            self.requests += not refused
            self.refused += refused


def listening(what: str, host: str, port: int,
              make: Callable[[socket.AddressFamily, tuple[str, int]], BoundedServer]) -> BoundedServer:
    """``make(family, (host, port))``, the server bound; RuntimeError with one line saying
    why not (``what``: the option as typed)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        return make(family, (host, port))
    except socket.gaierror as e:
        raise RuntimeError(f"{what}: cannot resolve {host!r}: {e.strerror}") from None
    except OSError as e:
        raise RuntimeError(f"{what}: cannot listen on {host} port {port}: {describe(e)}") from None


class BoundedServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """A TCP server of the family of its address, one thread per connection, at most
    ``most`` at once (``slots``): a connection beyond them is closed unanswered, so a flood
    of idle connections costs a few threads, not one each (the peer plane's, and the
    metrics endpoint's: daemon/metrics_http.py)."""
    daemon_threads = True
    allow_reuse_address = True   # a restarted daemon binds again past TIME_WAIT

    def __init__(self, family: socket.AddressFamily, address: tuple[str, int], handler: type,
                 most: int, what: str, level: int = logging.WARNING) -> None:
        self.address_family = family
        self.slots = threading.BoundedSemaphore(most)
        self.active: set[socket.socket] = set()   # (idle) connections being served
        self.idle = threading.Condition()
        self.most, self.what, self.level = most, what, level   # what is said, at what level
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            log.log(self.level, "%s: %d connections open; closing the one of %s", self.what,
                    self.most, client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        with self.idle:
            self.active.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
            with self.idle:
                self.active.discard(request)
                self.idle.notify_all()

    def handle_error(self, request, client_address) -> None:
        """A connection that ended under its request (the client gave up, the unmount shut
        it): said at DEBUG, not as a traceback on stderr."""
        log.debug("%s: the connection of %s ended: %s", self.what, client_address[0],
                  describe(sys.exc_info()[1]) if isinstance(sys.exc_info()[1], OSError)
                  else sys.exc_info()[1])

    def stop(self, wait: float) -> bool:
        """Stop serving: no new connection, the open ones shut (a transfer under way fails
        at once), and up to ``wait`` seconds for their threads to end; whether they did."""
        self.shutdown()
        with self.idle:
            for conn in self.active:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            done = self.idle.wait_for(lambda: not self.active, wait)
        self.server_close()
        return done


class Server(BoundedServer):
    def __init__(self, family: socket.AddressFamily, address: tuple[str, int], plane: Plane) -> None:
        self.plane = plane
        super().__init__(family, address, Handler, MAX_CONNECTIONS, "peer plane")


class _At:
    """A descriptor as ``socket.sendfile`` wants a file (its position is never used)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def seek(self, *_: object) -> None:
        pass


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "acpfs-peer"
    timeout = CLIENT_TIMEOUT
    server: Server

    def do_HEAD(self) -> None:
        self._serve(False)

    def do_GET(self) -> None:
        self._serve(True)

    def do_POST(self) -> None:
        nonce = self._check("")
        if nonce is not None:
            replicas_post(self, nonce)

    def _check(self, rng: str) -> str | None:
        """The request's nonce, or None once it is refused (401, the connection closed)."""
        plane = self.server.plane
        try:
            if plane.secret is None:
                raise Refused("this node has no usable secret")
            return plane.secret.check(self.headers.get("Authorization"), self.command,
                                      self.path, rng, plane.address)
        except Refused as e:
            plane.count(refused=True)
            log.log(plane.refusal_level(self.client_address[0]), "peer plane: refused %s %s "
                    "from %s: %s", self.command, self.path[:200], self.client_address[0], e)
            self.close_connection = True
            self._answer(401, {"Connection": "close"})
            return None

    def _serve(self, body: bool) -> None:
        plane = self.server.plane
        rng = self.headers.get("Range", "")
        nonce = self._check(rng)
        if nonce is None:
            return
        split = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(split.query)
        version = parse_version(query.get("v", [""])[0])
        if not split.path.startswith(PREFIX) or version is None:
            self._signed(400, nonce, "", "")
            return
        path = urllib.parse.unquote_to_bytes(split.path[len(PREFIX):])
        holder = plane.holder
        vtext = version_text(version)
        if not body:
            code, n = holder.state(path, version, query.get("pull") == ["1"]) \
                if holder is not None else (404, 0)
            plane.count()
            if code == 200:
                self._signed(200, nonce, vtext, "", {"Content-Length": str(n)})
            elif code == 202:
                self._signed(202, nonce, vtext, f"progress {n}", {"X-Acpfs-Progress": str(n)})
            else:
                self._signed(404, nonce, "", "")
            return
        held = holder.hold(path, version) if holder is not None else None
        if held is None:
            self._signed(404, nonce, "", "")
            plane.count()
            return
        ref, size, ready = held
        if ref is None:   # a copy from the backing about to begin: ask again
            self._not_yet(nonce, vtext, holder, path, version)
            return
        try:
            first, last = _range(rng, size)
            if first < 0:
                self._signed(416, nonce, vtext, "", {"Content-Range": f"bytes */{size}"})
                return
            deadline = time.monotonic() + READY_WAIT
            # a copy under way: its prefix is served
            while not (got := ready(last + 1, deadline - time.monotonic())):
                if got is None:
                    self._signed(404, nonce, "", "")
                    return
                if time.monotonic() >= deadline:   # not yet: the client asks again
                    self._not_yet(nonce, vtext, holder, path, version)
                    return
            crange = f"bytes {first}-{last}/{size}"
            self._signed(206, nonce, vtext, crange, {"Content-Range": crange,
                                                     "Content-Length": str(last + 1 - first)})
            self.wfile.flush()
            sent = self._send(holder, ref, size, first, last + 1)
            plane.count(sent)
        finally:
            holder.let_go(ref)

    def _not_yet(self, nonce: str, vtext: str, holder: Holder, path: bytes, version: Version) -> None:
        """503: the copy from the backing has not reached the range; with its progress, by
        which the client tells a copy that moves (or waits its turn) from one that stalled."""
        _, n = holder.state(path, version, False)
        self._signed(503, nonce, vtext, f"progress {n}",
                     {"Retry-After": "0", "X-Acpfs-Progress": str(n)})

    def _send(self, holder: Holder, ref: Any, size: int, start: int, end: int) -> int:
        sent = 0
        with holder.runs(ref, size) as (fd, runs):
            at = _At(fd)
            for off, src, n in runs:
                lo, hi = max(off, start), min(off + n, end)
                if lo >= hi:
                    continue
                sent += self.connection.sendfile(at, src + lo - off, hi - lo)
        if sent != end - start:   # the client must not take a short body for the whole
            self.close_connection = True
        return sent

    def _signed(self, code: int, nonce: str, vtext: str, crange: str,
                headers: dict[str, str] | None = None) -> None:
        secret = self.server.plane.secret
        assert secret is not None
        extra = {"X-Acpfs-Version": vtext, "X-Acpfs-Mac": secret.answer(nonce, code, vtext, crange)}
        self._answer(code, {**extra, **(headers or {})})

    def _answer(self, code: int, headers: dict[str, str]) -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:   # noqa: A002 (the base's name)
        log.debug("peer plane: %s %s", self.address_string(), format % args)


def _range(text: str, size: int) -> tuple[int, int]:
    """(first, last) of ``bytes=A-B`` within a file of ``size`` bytes; (-1, -1) if not."""
    unit, _, spec = text.partition("=")
    first, _, last = spec.partition("-")
    if unit.strip() != "bytes" or not first.isdigit() or not last.isdigit():
        return -1, -1
    a, b = int(first), min(int(last), size - 1)
    return (a, b) if a <= b else (-1, -1)



def replicas_post(h: Handler, nonce: str) -> None:
    """POST /v1/replicas/<origin>?first=N: a batch of the origin's journal (replicas.py).
    200 or 409 with ``X-Acpfs-Held`` (the next entry this node expects; 0: it will take no
    more of that origin) and, for 409, ``X-Acpfs-Why``; the rest of a body not taken is
    read and thrown away, so that the answer reaches the sender."""
    split = urllib.parse.urlsplit(h.path)
    query = urllib.parse.parse_qs(split.query)
    origin = split.path[len(REPLICAS):]
    first = query.get("first", [""])[0]
    length = h.headers.get("Content-Length", "")
    replicas = h.server.plane.replicas
    if not split.path.startswith(REPLICAS) or not origin.isalnum() or not first.isdigit() \
            or not length.isdigit():
        h.close_connection = True
        h._signed(400, nonce, "", "")
        return
    signer = dict(part.partition("=")[::2] for part in
                  h.headers.get("Authorization", "").partition(" ")[2].split()).get("node")
    body = _Counted(h.rfile, int(length))
    if signer != origin:   # a node sends its own changes, and drops only its own copy
        held, why = 0, f"node {signer} may not send the changes of {origin}"
    elif replicas is None:
        held, why = 0, "this node holds no replicas"
    else:
        try:
            held, why = replicas.receive(origin, int(first), body, int(length))
        except (OSError, EOFError, ValueError) as e:
            log.warning("peer plane: a batch of replicas from %s failed: %s", origin, e)
            h.close_connection = True
            held, why = 0, f"the batch could not be taken ({e})"
    body.discard()
    h._signed(409 if why else 200, nonce, "", f"held {held}",
              {"X-Acpfs-Held": str(held), **({"X-Acpfs-Why": why[:300]} if why else {})})


class _Counted:
    """A request body of ``n`` bytes: reads stop at its end; ``discard`` reads the rest."""

    def __init__(self, f: Any, n: int) -> None:
        self.f, self.left = f, n

    def read(self, n: int) -> bytes:
        data = self.f.read(min(n, self.left)) if self.left else b""
        self.left -= len(data)
        return data

    def discard(self) -> None:
        while self.left and self.read(1 << 20):
            pass
