"""systemd's service notification protocol (sd_notify(3)), spoken by the daemon itself.

Under a unit of ``Type=notify`` systemd passes ``NOTIFY_SOCKET``: the path of a datagram
socket, or ``@name`` for an abstract one. Each message is one datagram of ``KEY=VALUE``
lines. The daemon says:

- ``READY=1`` once the mount is live (after any recovery), so that a unit ordered after
  ``acpfs@...service`` starts on a working mount;
- ``STATUS=...`` every ``STATUS_EVERY`` seconds while it serves: unsaved files and bytes,
  operations to persist, the flush rate, a failing operation;
- ``STOPPING=1`` when it starts to drain at stop, then ``EXTEND_TIMEOUT_USEC=`` every
  ``STATUS_EVERY`` seconds while data is left to persist, so that systemd waits for the
  data rather than for a fixed ``TimeoutStopSec``.

Without ``NOTIFY_SOCKET`` every call does nothing. A message that cannot be sent is
logged once and dropped: notifications never stop the mount.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

STATUS_EVERY = 2.0     # s between STATUS (and, while draining, EXTEND_TIMEOUT_USEC) messages
EXTEND_BY = 30.0       # s each EXTEND_TIMEOUT_USEC grants; renewed every STATUS_EVERY


class Notifier:
    def __init__(self, address: str | None) -> None:
        self.address: str | None = None
        self._sock: socket.socket | None = None
        self._failed = False
        if not address:
            return
        if address.startswith("@"):
            self.address = "\0" + address[1:]
        elif address.startswith("/"):
            self.address = address
        else:
            log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket (@name): "
                        "systemd is not told when the mount is ready", address)
            return
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environment(cls) -> Notifier:
        """The notifier systemd asked for; the variable is taken out of the environment, so
        that a program the daemon starts does not speak for it."""
        return cls(os.environ.pop("NOTIFY_SOCKET", None))

    @property
    def on(self) -> bool:
        return self._sock is not None

    def send(self, **fields: object) -> None:
        if self._sock is None or self.address is None:
            return
        data = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(data, self.address)
        except OSError as e:
            if not self._failed:
                self._failed = True
                log.warning("cannot notify systemd at %r (%s); going on without", self.address, e)

    def ready(self, status: str) -> None:
        self.send(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def stopping(self, status: str) -> None:
        self.send(STOPPING=1, STATUS=status, EXTEND_TIMEOUT_USEC=int(EXTEND_BY * 1e6))

    def extend(self, status: str) -> None:
        """While draining: more time, and what is left."""
        self.send(STATUS=status, EXTEND_TIMEOUT_USEC=int(EXTEND_BY * 1e6))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
