"""The requests without FUSE: ``requests.Core`` (requests on names, xattrs, statfs, the
waits of global order), open files and directories (``handles``), what requests learn from
the backing (``loader``), the full cache and write-through (``writethrough``), files open for
writing a long time (``longopen``), and the ``user.acpfs.*`` control attributes with the
status document (``control``).

Owns: handles, the statfs answer, the background tasks handlers start.
May import: ``flusher``, ``cluster``, ``cache``, ``oplog``, ``store``, ``backing``, the
package root. Never ``fuse``, ``daemon`` or ``commands``.
"""
