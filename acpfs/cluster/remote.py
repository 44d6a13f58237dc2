"""The peer plane's client: asks other nodes (their plane: ``plane``) for a file in one
version, and takes their bytes only when every answer is signed and says that version and
exactly the range asked (docs/design.md, "Nodes serve each other from RAM").

Owns one HTTP/1.1 connection per thread and peer (``_conns``, kept alive between ranges),
and nothing else: which peer to ask, and where the bytes go, are the caller's
(core/peerreads.py). Every failure (a peer that does not answer within ``timeout``, refuses,
answers unsigned, with another version, another range, a short body) is a ``PeerError``
with one line saying which peer and what; the caller then reads the backing.

Threads: any; each thread has its own connections (``threading.local``).
"""

from __future__ import annotations

import http.client
import threading
import time
from typing import Callable, Iterator

from ..backing.retry import describe
from .auth import Refused, Secret
from .plane import REPLICAS, Version, parse_address, target_of, version_text

TIMEOUT = 5.0       # s a peer may take to answer a request, or between two reads of a body
STALL = 10.0        # s a peer copying a file from the backing may take to reach a range
AGAIN = 0.01        # s before a range not there yet is asked for again
PIECE = 1 << 20     # bytes read from the socket at a time
REPLICA_TIMEOUT = 30.0   # s a holder may take to take a piece of a batch of replicas


class PeerError(Exception):
    """A peer that could not be used for a file: why, in one line (it names the peer)."""


class Remote:
    def __init__(self, secret: Secret, timeout: float = TIMEOUT) -> None:
        self.secret = secret
        self.timeout = timeout
        self._conns = threading.local()

    def _conn(self, address: str) -> http.client.HTTPConnection:
        conns = getattr(self._conns, "map", None)
        if conns is None:
            conns = self._conns.map = {}
        c = conns.get(address)
        if c is None:
            host, port = parse_address(address, "peer address")
            c = conns[address] = http.client.HTTPConnection(host, port, timeout=self.timeout)
        return c

    def _drop(self, address: str) -> None:
        c = getattr(self._conns, "map", {}).pop(address, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        """Close this thread's connections."""
        for address in list(getattr(self._conns, "map", {})):
            self._drop(address)

    def _request(self, address: str, method: str, path: bytes, version: Version,
                 rng: str = "", pull: bool = False) -> tuple[http.client.HTTPResponse, str]:
        target = target_of(path, version, pull)
        auth, nonce = self.secret.sign(method, target, rng, address)
        headers = {"Authorization": auth, **({"Range": rng} if rng else {})}
        for attempt in (0, 1):   # a kept connection the peer closed meanwhile: once more
            c = self._conn(address)
            try:
                c.request(method, target, headers=headers)
                return c.getresponse(), nonce
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self._drop(address)
                if attempt:
                    raise PeerError(f"peer {address}: {describe(e)}") from None
            except (OSError, http.client.HTTPException) as e:
                self._drop(address)
                raise PeerError(f"peer {address}: {describe(e) if isinstance(e, OSError) else e}") \
                    from None
        raise AssertionError("unreachable")

    def ask(self, address: str, path: bytes, version: Version, pull: bool = False) -> tuple[str, int]:
        """What the peer at ``address`` has of ``path`` in ``version`` (HEAD): ("held",
        size), ("pulling", bytes copied from the backing so far), or ("", 0); ``pull``: ask
        it to copy the file from the backing for the job if it neither holds nor copies it."""
        resp, nonce = self._request(address, "HEAD", path, version, pull=pull)
        resp.read()
        if resp.status == 404:
            self._believe(address, resp, nonce, "", "")
            return "", 0
        vtext = version_text(version)
        if resp.status == 202:
            n = resp.getheader("X-Acpfs-Progress", "")
            self._believe(address, resp, nonce, vtext, f"progress {n}")
            if not n.isdigit() or int(n) > version[1]:
                raise PeerError(f"peer {address}: copying {n!r} bytes of a file of {version[1]}")
            return "pulling", int(n)
        self._believe(address, resp, nonce, vtext, "")
        if resp.status != 200 or resp.getheader("Content-Length") != str(version[1]):
            self._drop(address)
            raise PeerError(f"peer {address}: answered {resp.status} with "
                            f"{resp.getheader('Content-Length')} bytes for a file of {version[1]}")
        return "held", version[1]

    def get(self, address: str, path: bytes, version: Version, off: int, n: int,
            put: Callable[[int, memoryview], None], buf: memoryview) -> None:
        """Bytes [off, off + n) of ``path`` in ``version`` from the peer at ``address``,
        handed to ``put(offset, bytes)`` piece by piece (through ``buf``)."""
        rng = f"bytes={off}-{off + n - 1}"
        crange = f"bytes {off}-{off + n - 1}/{version[1]}"
        vtext = version_text(version)
        since, last = time.monotonic(), ""
        while True:   # 503: the peer copies the file from the backing, not this far yet
            resp, nonce = self._request(address, "GET", path, version, rng)
            if resp.status != 503:
                break
            resp.read()
            progress = resp.getheader("X-Acpfs-Progress", "")
            self._believe(address, resp, nonce, vtext, f"progress {progress}")
            if progress != last:
                since, last = time.monotonic(), progress
            elif time.monotonic() - since > STALL:
                # no progress: a copy waiting its turn there still says it copies
                if self.ask(address, path, version)[0] != "pulling":
                    raise PeerError(f"peer {address}: its copy from the backing stopped at "
                                    f"{progress or 0} bytes, before byte {off + n} of {version[1]}")
                since = time.monotonic()
            time.sleep(AGAIN)
        try:
            if resp.status != 206:
                resp.read()
                raise PeerError(f"peer {address}: answered {resp.status} {resp.reason} for "
                                f"{path.decode(errors='replace')}")
            self._believe(address, resp, nonce, vtext, crange)
            if resp.getheader("Content-Range") != crange or \
                    resp.getheader("Content-Length") != str(n):
                raise PeerError(f"peer {address}: sent {resp.getheader('Content-Range')} "
                                f"({resp.getheader('Content-Length')} bytes) for {crange}")
            done = 0
            while done < n:
                want = min(len(buf), n - done)
                try:
                    got = resp.readinto(buf[:want])
                except OSError as e:
                    raise PeerError(f"peer {address}: {describe(e)} after {done} of {n} bytes") \
                        from None
                if not got:
                    raise PeerError(f"peer {address}: the body ended after {done} of {n} bytes")
                put(off + done, buf[:got])
                done += got
        except BaseException:
            self._drop(address)
            raise

    def replicate(self, address: str, origin: str, first: int, body: Iterator[bytes],
                  length: int) -> tuple[int, str]:
        """Send a batch of this node's journal (replicate.py) to the peer at ``address``:
        (the next entry it expects, "" or why it stopped short)."""
        target = f"{REPLICAS}{origin}?first={first}"
        auth, nonce = self.secret.sign("POST", target, "", address)
        host, port = parse_address(address, "peer address")
        c = http.client.HTTPConnection(host, port, timeout=REPLICA_TIMEOUT)
        try:
            c.request("POST", target, body=body, headers={"Authorization": auth,
                                                           "Content-Length": str(length)})
            resp = c.getresponse()
            resp.read()
            held = resp.getheader("X-Acpfs-Held", "")
            if resp.status not in (200, 409) or not held.isdigit():
                raise PeerError(f"peer {address}: answered {resp.status} {resp.reason} to replicas")
            self._believe(address, resp, nonce, "", f"held {held}")
            return int(held), resp.getheader("X-Acpfs-Why", "") if resp.status == 409 else ""
        except (OSError, http.client.HTTPException) as e:
            raise PeerError(f"peer {address}: {describe(e) if isinstance(e, OSError) else e}") \
                from None
        finally:
            c.close()

    def _believe(self, address: str, resp: http.client.HTTPResponse, nonce: str, vtext: str,
                 crange: str) -> None:
        try:
            if resp.status == 401:
                raise Refused("it refused this node's signature (another secret?)")
            if resp.getheader("X-Acpfs-Version", "") != vtext:
                raise Refused(f"it serves version {resp.getheader('X-Acpfs-Version')!r}, "
                              f"not {vtext!r}")
            self.secret.believe(resp.getheader("X-Acpfs-Mac"), nonce, resp.status, vtext, crange)
        except Refused as e:
            self._drop(address)
            raise PeerError(f"peer {address}: {e}") from None
