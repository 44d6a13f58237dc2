"""Every system call on the backing directory, never following a symlink or ``..``
(``backing.Backing``, made of ``root``, ``reads``, ``changes``, ``staging`` and ``records``),
the names acpfs keeps there (``names``), and the one retry helper (``retry``).

Owns: the root descriptor, this daemon's temporary names.
May import: ``store`` (copying content into a file) and the package root.
"""
