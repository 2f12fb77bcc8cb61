"""Object storage (``s3://bucket/key``) as a source and destination of the engine.

- :mod:`~gdskit.engine.objects.url`: which paths are object URLs, and their parts.
- :mod:`~gdskit.engine.objects.store`: the client (botocore, gdskit's retries, errors, ledger rows).
- :mod:`~gdskit.engine.objects.source`: :class:`~gdskit.engine.objects.source.ObjectFile`, the
  object with :class:`gdskit.File`'s API, reading through the engine's pinned lanes.
- :mod:`~gdskit.engine.objects.uploads`: multipart uploads left under way by writers that died,
  listed and aborted (``gdskit uploads``).

Layers above reach these through the engine's door (``gdskit.engine``).
"""
