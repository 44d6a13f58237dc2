"""The daemon's Prometheus endpoint (``acpfs mount --metrics HOST:PORT``).

Owns the address as typed and checked (``parse_address``: a bare ``PORT`` or ``:PORT`` is
loopback, any other host only when named), the listening socket, bound before the mount
starts so that a port in use refuses the mount in one line, and the thread that serves it
(``Endpoint``). ``GET /metrics`` answers the text of ``metrics.render`` for the mount; any
other path is 404, any other method 501. Each scrape runs in a thread of its own with a
timeout, so a slow or stuck client holds nobody and the FUSE loop never waits for one; at
most ``METRICS_MAX_SCRAPES`` at once, a connection beyond them is closed unanswered (a
flood of idle connections costs a few threads, not one each). The
daemon's ``render`` callable takes the status document (``Daemon._document``): on the FUSE
loop's thread while it runs, like ``user.acpfs.status``; during the drain at unmount, when
no request runs any more, in the scrape's thread. While the daemon starts (a recovery may
take minutes) scrapes get 503; once it has drained, the socket is closed.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import urllib.parse
from typing import Callable

from ..config import METRICS_CLIENT_TIMEOUT, METRICS_MAX_SCRAPES, parse_address
from .metrics import CONTENT_TYPE
from ..cluster.plane import BoundedServer, listening

log = logging.getLogger(__name__)
PATH = "/metrics"


class Unavailable(Exception):
    """The daemon has no document to render yet (503): why, in one line."""


class Endpoint:
    """The listening socket of ``--metrics`` and the thread that serves it. Built bound
    (an ``OSError`` made one line otherwise, as ``RuntimeError``); ``start`` serves,
    ``close`` stops."""

    def __init__(self, text: str, render: Callable[[], str]) -> None:
        host, port = parse_address(text)
        self.server = listening(f"--metrics {text}", host, port,
                                lambda family, address: Server(family, address, render))
        bound = self.server.server_address
        self.address = (f"[{bound[0]}]:{bound[1]}" if self.server.address_family == socket.AF_INET6
                        else f"{bound[0]}:{bound[1]}")
        self.thread = threading.Thread(target=self.server.serve_forever, name="acpfs-metrics",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()
        log.info("Prometheus metrics at http://%s%s", self.address, PATH)

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()


class Server(BoundedServer):
    """One thread per scrape, at most ``METRICS_MAX_SCRAPES`` (``BoundedServer``), holding
    the callable that renders the text."""

    def __init__(self, family: socket.AddressFamily, address: tuple[str, int],
                 render: Callable[[], str]) -> None:
        self.render = render
        super().__init__(family, address, Handler, METRICS_MAX_SCRAPES, "metrics", logging.DEBUG)


class Handler(http.server.BaseHTTPRequestHandler):
    """One scrape: ``GET /metrics`` (query ignored), else 404."""
    timeout = METRICS_CLIENT_TIMEOUT
    server_version = "acpfs"
    protocol_version = "HTTP/1.0"
    server: Server

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path != PATH:
            self.reply(404, f"not found: the metrics are at {PATH}\n")
            return
        try:
            text = self.server.render()
        except Unavailable as e:
            self.reply(503, f"{e}\n")
            return
        except Exception:
            log.exception("rendering the metrics failed")
            self.reply(500, "rendering the metrics failed: see the daemon's log\n")
            return
        self.reply(200, text, CONTENT_TYPE)

    def reply(self, code: int, text: str, ctype: str = "text/plain; charset=utf-8") -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:   # noqa: A002 (the base's name)
        log.debug("metrics: %s %s", self.address_string(), format % args)
