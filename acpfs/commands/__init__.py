"""The ``acpfs`` command and how programs talk to a running mount: the parser and the
commands (``cli``), the client of the control attributes (``client``), the mount helper
``mount.fuse.acpfs`` (``mounthelper``), what ``sync`` and ``umount`` wait for (``syncing``),
``status --watch`` (``watch``), progress lines (``progress``), and leftover temporary files
(``leftovers``).

Owns: nothing that outlives a command.
May import: everything. Nothing in the daemon's side imports it.
"""
