"""A daemon's life: its phases (``daemon``), replaying a dead daemon's journal
(``recovery``), the health rule (``health``), Prometheus metrics and their endpoint
(``metrics``, ``metrics_http``), systemd's notifications (``sdnotify``), and when the
interpreter's cycle collector runs (``collector``).

Owns: the process: logging, locks, the mount record, the threads it starts.
May import: every layer below (``fuse``, ``core``, ``flusher``, ``cluster``, ``cache``,
``oplog``, ``store``, ``backing``) and the package root. Never ``commands``.
"""
