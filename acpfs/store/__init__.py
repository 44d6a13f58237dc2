"""The content store: its interface (``api.Store``, ``CacheFull``), the daemon's path's
block pool (``pool``) and the passthrough path's one file per cached file (``filestore``).

Owns: the bytes of cached files and the count of what they use.
May import: the package root only.
"""
