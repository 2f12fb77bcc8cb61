"""A DCP checkpoint's ``.metadata`` pickle, read with an unpickler that knows only DCP's own classes.

DCP writes the metadata with :func:`pickle.dump`, and torch's reader loads it with
:func:`pickle.load`, which runs whatever callable the file names: a checkpoint directory another
user can write would run their code in the training job. Here the unpickler resolves only the
names a DCP ``Metadata`` is made of (its dataclasses, ``torch.Size``, torch's dtypes, layouts and
memory formats, paths); any other name is refused before anything is called, and every malformed
stream becomes a :class:`~gdskit.errors.FormatError`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from gdskit.errors import FormatError

#: The names a DCP ``Metadata`` pickle is made of (torch 2.x; each seen in torch's own files).
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
}


def _torch_constant(name: str) -> Any:
    """A dtype, layout or memory format of torch by name (DCP pickles them as globals), else None."""
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and _torch_constant(name) is not None:
            return _torch_constant(name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP checkpoint metadata")


def load_metadata(data: bytes, path: str) -> Any:
    """The object the metadata pickle ``data`` (read from ``path``) holds; FormatError naming the
    file where it is refused or malformed."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except RecursionError:
        raise FormatError(f"{path}: checkpoint metadata nested too deep") from None
    except MemoryError:
        raise FormatError(f"{path}: checkpoint metadata asks for more memory than there is") from None
    except Exception as exc:  # noqa: BLE001 - a hostile stream can make any allowed call raise anything
        raise FormatError(f"{path}: unreadable checkpoint metadata: {exc}") from None


def checked_metadata(obj: Any, path: str) -> Any:
    """``obj`` if it is a DCP ``Metadata`` of the types DCP's planners and gdskit's reader rely
    on, else a FormatError naming ``path`` and what is wrong. An item's file must lie inside the
    checkpoint's directory: a relative path with no ``..`` (an absolute one, or one climbing out,
    would read any file the job can read into its state)."""
    if not isinstance(obj, Metadata):
        raise FormatError(f"{path}: holds {type(obj).__name__}, not checkpoint metadata")
    try:
        _check_items(obj.state_dict_metadata, path)
        _check_storage(obj.storage_data, path)
        if obj.storage_meta is not None and type(obj.storage_meta) is not StorageMeta:
            raise _bad(path, f"its storage meta is {type(obj.storage_meta).__name__}")
        planner = obj.planner_data  # a planner's own (torch's: item names to their paths in the state dict)
        if planner is not None and not (type(planner) is dict and all(type(k) is str for k in planner)):
            raise _bad(path, "its planner data is not a map of item names")
    except AttributeError as exc:  # a field the file left out of an object it names
        raise _bad(path, str(exc)) from None
    return obj


def _bad(path: str, what: str) -> FormatError:
    return FormatError(f"{path}: not valid checkpoint metadata: {what}")


def _check_size(v: Any, what: str, path: str) -> None:
    if type(v) is not torch.Size or any(d < 0 for d in v):
        raise _bad(path, f"{what} is {v!r:.60}, not a size")


def _check_items(items: Any, path: str) -> None:
    if type(items) is not dict:
        raise _bad(path, "its items are not a dict")
    for fqn, item in items.items():
        if type(fqn) is not str:
            raise _bad(path, f"item name {fqn!r:.60} is not a string")
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata:
            raise _bad(path, f"{fqn!r} is {type(item).__name__}")
        props = item.properties
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
            raise _bad(path, f"{fqn!r}: tensor properties without a dtype")
        _check_size(item.size, f"{fqn!r}'s size", path)
        if type(item.chunks) is not list:
            raise _bad(path, f"{fqn!r}: chunks are not a list")
        for chunk in item.chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise _bad(path, f"{fqn!r}: a chunk is {type(chunk).__name__}")
            _check_size(chunk.offsets, f"{fqn!r}'s chunk offsets", path)
            _check_size(chunk.sizes, f"{fqn!r}'s chunk sizes", path)
            if len(chunk.offsets) != len(item.size) or len(chunk.sizes) != len(item.size) or any(
                    o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, item.size)):
                raise _bad(path, f"{fqn!r}: a chunk lies outside the tensor's size {list(item.size)}")


def _check_storage(storage: Any, path: str) -> None:
    if storage is None:
        return
    if type(storage) is not dict:
        raise _bad(path, "its storage map is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise _bad(path, f"storage key {index!r:.60}")
        rel, offset, length = info.relative_path, info.offset, info.length
        if type(rel) is not str or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise _bad(path, f"the storage of {index.fqn!r} is not a file, offset and length")
        parts = rel.replace("\\", "/").split("/")
        if not rel or rel.startswith("/") or ".." in parts or "\0" in rel:
            raise _bad(path, f"the storage of {index.fqn!r} is in {rel!r:.80}, outside the checkpoint's directory")
