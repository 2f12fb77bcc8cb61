"""Every tensor of a (possibly sharded) safetensors checkpoint: which file holds it, where.

Pure Python. Reads and validates every shard's header before anything else happens,
so a bad shard is refused before a byte of data moves.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import NamedTuple

from gdskit.errors import FormatError
from gdskit.formats import safetensors_format as fmt


class Located(NamedTuple):
    """One tensor record: the shard ``path`` it is in, the ``file_offset`` of its bytes, its
    ``entry``. A named tuple: a checkpoint of 20,000 tensors makes 20,000 of them."""

    path: str
    file_offset: int
    entry: fmt.TensorEntry


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """The shards in reading order, and every tensor by name in file order (shard by shard,
    ascending offsets within a shard)."""

    headers: tuple[tuple[str, fmt.Header], ...]
    tensors: dict[str, Located]


def index_checkpoint(path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> ShardIndex:
    """Read every shard's header (see :func:`gdskit.formats.safetensors_format.resolve_checkpoint`
    for what ``path_or_paths`` may be).

    Raises
    ------
    gdskit.errors.FormatError
        A header is invalid, a file is shorter than its header says, a name is in two
        shards, or the index file names a shard that does not hold the tensor.
    """
    shards = fmt.resolve_checkpoint(path_or_paths)
    headers = tuple((p, fmt.read_header_file(p)) for p in shards.files)
    where: dict[str, Located] = {}
    make = tuple.__new__  # a named tuple without its Python-level __new__: headers hold thousands
    for p, h in headers:
        start = h.data_start
        for e in h.entries:
            name = e.name
            if name in where:
                raise fmt.HeaderError(f"tensor {name!r} is in both {where[name].path} and {p}")
            where[name] = make(Located, (p, start + e.start, e))
    if shards.weight_map is not None:
        for name, p in shards.weight_map.items():
            if name not in where or os.path.abspath(where[name].path) != os.path.abspath(p):
                raise FormatError(f"index says {name!r} is in {p}, but it is not there", path=shards.index)
    return ShardIndex(headers, where)
