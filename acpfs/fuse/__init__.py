"""The kernel edge: the thin pyfuse3 adapter (``operations``) that turns each FUSE request
into one call of ``core``, the C hook for WRITE and FALLOCATE (``fastwrite``,
``_fastwrite.c``), and the kernel's passthrough (``passthrough``).

Owns: lookup counts, the one errno mapping, the kernel's cache notices, the FUSE session.
May import: everything below it (``core``, ``cache``, ``oplog``, ``store``, ``backing``, the
package root). Nothing below imports it; ``core`` knows the passthrough calls only through
the type it is handed.
"""
