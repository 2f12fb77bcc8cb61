"""The three ways bytes move: cuFile, gdskit's pinned bounce ring, and plain host I/O.

Each backend implements :class:`gdskit.engine.backends.base.Backend` and passes the
shared conformance suite in ``tests/support/backend_conformance.py``.
"""
