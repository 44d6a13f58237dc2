"""The mount's view, independent of FUSE: the inode table (``inodes``), the names and every
change of a name (``namespace``), file content with its eviction (``files``), and the view
against a backing other writers change (``coherence``); ``cache.Cache`` builds them.

Owns: the nodes and their content handles, the LRU, the backing positions (``position_lock``).
May import: ``oplog``, ``store``, ``backing``, the package root.
"""
