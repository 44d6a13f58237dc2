"""The peer plane's secret, and the signatures that prove it without sending it
(docs/design.md, "Nodes serve each other from RAM").

Owns the secret of one backing (``Secret``): 32 random bytes in
``<backing>/.acpfs-nodes/.peer-secret``, made with the records directory's first peer plane,
mode 0600, so that only the backing's owner (the user whose daemons keep records there) can
read it; a mount over another backing holds another secret. ``load`` reads it, or makes it
when there is none (``NodeRecords.create_secret``, exclusively: two nodes starting at once
end with one secret; one that reads it before its maker wrote it reads again, for up to
``SETTLE`` seconds). A secret that others may read
(group or world bits), that is not a regular file, that belongs to a user whose records do
not count (``RecordsDir.owners``), or that is not 64 hex digits is refused: ``Refused``,
and the daemon serves no peer plane (status says why).

A request carries ``Authorization: ACPFS1 node=<instance> ts=<unix time> nonce=<hex>
mac=<hex>``, the HMAC-SHA256 under the secret of the method, the target, the range, the
server it is for (its address, as the records give it), the time and the nonce (``sign``).
The server believes it only when the MAC matches with its own address, the time is within
``WINDOW`` of its own clock and not before the server started (``STARTED_SLACK`` aside),
and the nonce was not seen in that window (``check``): a request copied off the wire cannot
be sent again, to this node or to another. Nonces are kept by their signed time (a heap)
and forgotten once out of the window (``_seen``, ``_order``). Its answer carries ``X-Acpfs-Mac``, the
HMAC of the request's nonce, the status, the version it serves and the range
(``answer``), which the client checks (``believe``): an answer from anything without the
secret (another backing's node, a stray server on the port) is not believed. The secret
itself never crosses the network, with or without TLS; the bytes of a file do, in the clear
(the backing's own protocol, NFS without krb5p, sends them so too).

Threads: any; the nonces seen are guarded by ``_lock``.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import secrets
import stat
import threading
import time

from .records import RecordsDir

log = logging.getLogger(__name__)

SECRET_NAME = b".peer-secret"
SCHEME = "ACPFS1"
WINDOW = 300.0       # s: a signed request is believed this long around the server's clock
NONCES_MAX = 2_000_000   # nonces in the window at most (each request has one): about 6,600/s
STARTED_SLACK = 5.0  # s a request may be signed before its server started (the nodes' clocks)
SETTLE = 2.0         # s a secret just made by another node may stay empty


class Refused(Exception):
    """A request or an answer not believed, or a secret not used: why, in one line."""


class Secret:
    """The secret of one backing, and the nonces its server has seen."""

    def __init__(self, key: bytes, instance: str) -> None:
        self.key = key
        self.instance = instance
        self._seen: set[str] = set()   # nonces of requests signed within the window
        self._order: list[tuple[float, str]] = []   # (ts, nonce), a heap: the oldest first
        self._lock = threading.Lock()
        self.started = time.time()

    @classmethod
    def load(cls, records: RecordsDir, instance: str) -> Secret:
        """The secret of the records directory ``records`` (made there if there is none);
        ``Refused`` if the one there may not be used, ``OSError`` if it cannot be read."""
        back = records.backing()
        got = back.read_secret(SECRET_NAME)
        if got is None:
            if back.create_secret(SECRET_NAME, secrets.token_hex(32).encode()):
                log.info("peer plane: made the secret %s/%s (mode 0600)", records.dir,
                         SECRET_NAME.decode())
            got = back.read_secret(SECRET_NAME)
        deadline = time.monotonic() + SETTLE
        while got is not None and len(got[0]) < 64 and time.monotonic() < deadline:
            time.sleep(0.05)   # made by another node a moment ago: its bytes come next
            got = back.read_secret(SECRET_NAME)
        if got is None:
            raise Refused(f"the secret {records.dir}/{SECRET_NAME.decode()} vanished as it "
                          "was made")
        data, st = got
        where = f"{records.dir}/{SECRET_NAME.decode()}"
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{where} is not a regular file")
        if st.st_mode & 0o077:
            raise Refused(f"{where} is readable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                          "make it 0600 (chmod 600), or remove it and mount again")
        if st.st_uid not in records.owners:
            raise Refused(f"{where} belongs to uid {st.st_uid}, whose node records do not count")
        text = data.strip()
        if len(text) != 64 or any(c not in b"0123456789abcdef" for c in text):
            raise Refused(f"{where} is not 64 hex digits; remove it and mount again")
        return cls(bytes.fromhex(text.decode()), instance)

    # -- requests ---------------------------------------------------------------------------
    def _mac(self, *parts: str) -> str:
        return hmac.new(self.key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()

    def sign(self, method: str, target: str, rng: str, server: str) -> tuple[str, str]:
        """(the Authorization header of a request to ``server``, its nonce)."""
        ts = f"{time.time():.3f}"
        nonce = secrets.token_hex(16)
        mac = self._mac(SCHEME, method, target, rng, server, ts, nonce)
        return f"{SCHEME} node={self.instance} ts={ts} nonce={nonce} mac={mac}", nonce

    def check(self, header: str | None, method: str, target: str, rng: str, server: str) -> str:
        """The nonce of a request to ``server`` (this node's address) whose Authorization
        header proves the secret; ``Refused`` otherwise (none, another scheme, a wrong MAC,
        for another server, out of the window, seen before)."""
        if not header:
            raise Refused("no Authorization header")
        scheme, _, rest = header.partition(" ")
        if scheme != SCHEME:
            raise Refused(f"not the {SCHEME} scheme")
        fields = dict(part.partition("=")[::2] for part in rest.split())
        ts, nonce, mac = fields.get("ts", ""), fields.get("nonce", ""), fields.get("mac", "")
        if not (ts and nonce and mac) or len(nonce) > 64:
            raise Refused("an incomplete signature")
        if not same(mac, self._mac(SCHEME, method, target, rng, server, ts, nonce)):
            raise Refused(f"a wrong signature (from node {fields.get('node', '?')[:16]!r}: "
                          "another secret or backing, or a request for another node)")
        try:
            signed = float(ts)
        except ValueError:
            raise Refused("a signature with no time") from None
        now = time.time()
        if abs(now - signed) > WINDOW:
            raise Refused(f"a signature {abs(now - signed):.0f} s away from this node's clock "
                          f"(at most {WINDOW:.0f} s)")
        if signed < self.started - STARTED_SLACK:
            raise Refused("a signature made before this daemon started (a request sent again)")
        with self._lock:
            order = self._order
            while order and order[0][0] < now - WINDOW:   # out of the window: refused anyway
                self._seen.discard(heapq.heappop(order)[1])
            if nonce in self._seen:
                raise Refused("a signature used before (a request sent again)")
            if len(self._seen) >= NONCES_MAX:
                raise Refused("too many requests in the window")
            self._seen.add(nonce)
            heapq.heappush(order, (signed, nonce))
        return nonce

    # -- answers ----------------------------------------------------------------------------
    def answer(self, nonce: str, status: int, version: str, rng: str) -> str:
        """The X-Acpfs-Mac of an answer to the request of ``nonce``."""
        return self._mac(SCHEME, "answer", nonce, str(status), version, rng)

    def believe(self, mac: str | None, nonce: str, status: int, version: str, rng: str) -> None:
        """``Refused`` unless ``mac`` proves the answer came from a holder of the secret."""
        if not mac or not same(mac, self.answer(nonce, status, version, rng)):
            raise Refused("an answer not signed with this backing's secret")


def same(mac: str, expected: str) -> bool:
    """Whether ``mac`` is ``expected``, in constant time (any characters: as bytes)."""
    return hmac.compare_digest(mac.encode("utf-8", "replace"), expected.encode())

