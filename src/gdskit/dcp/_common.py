"""What the writer and the reader share: file names, where they live, errors."""

from __future__ import annotations

import os
from typing import Any

from gdskit.engine import is_object_url
from gdskit.errors import GdskitError

#: The stock layout's names (torch.distributed.checkpoint.filesystem).
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"


class IncompleteCheckpointError(GdskitError, FileNotFoundError):
    """The directory holds no complete checkpoint: its ``.metadata`` file is missing.

    A save that failed or was interrupted leaves exactly this state; the
    checkpoint cannot be loaded (nor by torch's own reader).
    """


class CheckpointExistsError(GdskitError, FileExistsError):
    """A complete checkpoint is already in the directory and ``overwrite=False``."""


class UnsupportedItemError(GdskitError, ValueError):
    """An item of the checkpoint uses a feature this storage layer does not implement
    (stream transforms such as compression, or a tensor that has no plain bytes)."""


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__{rank}.metadata`` for a save without rank coordination."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def member(location: str, name: str) -> str:
    """The file ``name`` of the checkpoint at ``location``: a file in its directory, or the
    object ``name`` under its prefix (``s3://bucket/ckpt`` and ``s3://bucket/ckpt/`` are the same
    prefix)."""
    if is_object_url(location):
        return location.rstrip("/") + "/" + name
    return os.path.join(location, name)


def item_name(index: Any) -> str:
    """What the digest manifest calls one item (a ``MetadataIndex``): its fully qualified name,
    and for a tensor the offsets of its chunk, ``"layer.weight@[0,0]"`` (the chunks of a sharded
    tensor are items of their own)."""
    if index.offset is None:
        return str(index.fqn)
    return f"{index.fqn}@[{','.join(str(int(o)) for o in index.offset)}]"
