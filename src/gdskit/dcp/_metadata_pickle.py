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
