"""A DCP checkpoint's ``.metadata`` pickle, read with an unpickler that knows only DCP's own classes.

DCP writes the metadata with :func:`pickle.dump`, and torch's reader loads it with
:func:`pickle.load`, which runs whatever callable the file names: a checkpoint directory another
user can write would run their code in the training job. Here the unpickler resolves only the
names a DCP ``Metadata`` is made of (its dataclasses, ``torch.Size``, torch's dtypes, layouts and
memory formats, paths); any other name is refused before anything is called, and every malformed
stream becomes a :class:`~gdskit.errors.FormatError`.
"""

from __future__ import annotations

import collections
import pickle
import struct
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
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


#: The classes a BUILD may fill: DCP's metadata dataclasses, whose state is their fields.
_BUILDABLE = frozenset({Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                        MetadataIndex, StorageMeta, _StorageInfo})


def _torch_constant(name: str) -> Any:
    """A dtype, layout or memory format of torch by name (DCP pickles them as globals), else None."""
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class _Refused(Exception):
    """A stream the bounded unpickler will not follow (turned into a FormatError naming the file)."""


class _BoundedInput:
    """The file's bytes as the unpickler reads them: a read past the end is refused before
    anything of its declared size is made."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def _take(self, n: int) -> memoryview:
        if n < 0 or n > len(self._data) - self._pos:
            raise _Refused(f"declares {n} bytes where {len(self._data) - self._pos} are left")
        part = self._data[self._pos:self._pos + n]
        self._pos += n
        return part

    def read(self, n: int = -1) -> bytes:
        return bytes(self._take(len(self._data) - self._pos if n < 0 else n))

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        view[:] = self._take(len(view))
        return len(view)

    def readline(self) -> bytes:
        end = self._data.obj.find(b"\n", self._pos)
        return self.read(len(self._data) - self._pos if end < 0 else end + 1 - self._pos)


#: What a dict key, a set item or an allowed call's argument may be: flat values, whose hash and
#: copy cost what they hold (a nested tuple's hash recurses in C and can crash the process).
_SCALARS = (type(None), bool, int, float, str, bytes)
#: Units of work (references copied, characters joined) a stream may ask of calls and builds, per
#: byte of the file, beyond a small allowance; a file torch wrote asks for less than one per byte.
_WORK_PER_BYTE = 4
_WORK_ALLOWANCE = 1 << 16
#: Most fields a class's own ``__setstate__`` takes as a tuple (TensorProperties: five).
_MAX_SETSTATE_FIELDS = 8
#: Deepest tuple inside tuples a stream may build (DCP nests two: a state tuple holding a Size).
#: Each level of a deeper one costs a tuple's memory for one opcode byte, and hashing it recurses.
_MAX_TUPLE_DEPTH = 4
#: How much of a value an error message shows.
_SHOWN_CHARS, _SHOWN_ITEMS = 60, 6


def _flat_size(value: Any) -> int | None:
    """What copying ``value`` costs, if it is a scalar or a flat tuple or list of scalars; else None."""
    kind = type(value)
    if kind in _SCALARS:
        return len(value) if kind is str or kind is bytes else 1
    if (kind is tuple or kind is list or kind is torch.Size) and all(type(v) in _SCALARS for v in value):
        return len(value) + sum(len(v) for v in value if type(v) is str or type(v) is bytes)
    return None


def _is_flat_key(key: Any) -> bool:
    """Whether ``key`` hashes in time and stack bounded by its own size."""
    if type(key) in _SCALARS:
        return True
    if type(key) is MetadataIndex:  # its hash is that of its fields, which a BUILD may have set to anything
        fields = key.__dict__
        return (type(fields.get("fqn")) is str and type(fields.get("offset")) in (type(None), torch.Size)
                and type(fields.get("index")) in (type(None), int))
    return type(key) is tuple and all(type(v) in _SCALARS for v in key)


def _empty_ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    """``OrderedDict`` as pickles make it: empty, then filled by SETITEMS (whose keys are checked)."""
    if args:
        raise _Refused("an OrderedDict made from arguments")
    return collections.OrderedDict()


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: each of its steps can be bounded
    """Python's own unpickler with each step that could cost more than its bytes bounded.

    The C unpickler grows its memo to twice any index a stream names (one 6-byte opcode asks for
    gigabytes) and allocates a declared length before reading it, and calls of the allowed classes
    can copy one memoized container again and again. Here reads are checked against the bytes left,
    the memo is a dict, calls and builds take only flat arguments and are charged against a budget
    of work proportional to the file's size, keys are flat, and containers are filled only as
    themselves (never through an attribute a BUILD planted).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        super().__init__(_BoundedInput(data))
        self._work_left = _WORK_PER_BYTE * len(data) + _WORK_ALLOWANCE
        self._tuple_depths: dict[int, tuple[tuple[Any, ...], int]] = {}  # by id, holding each tuple alive

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and _torch_constant(name) is not None:
            return _torch_constant(name)
        if module == "collections" and name == "OrderedDict":
            return _empty_ordered_dict
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP checkpoint metadata")

    def _charge(self, units: int) -> None:
        self._work_left -= units
        if self._work_left < 0:
            raise _Refused("asks for more work than a file of its size can describe")

    def _flat_args(self, args: Any, what: str) -> tuple[Any, ...]:
        if type(args) is not tuple:
            raise _Refused(f"{what} with arguments that are not a tuple")
        for arg in args:
            size = _flat_size(arg)
            if size is None:
                raise _Refused(f"{what} with a {type(arg).__name__} argument")
            self._charge(size)
        return args

    @staticmethod
    def _flat_keys(keys: Any) -> Any:
        for key in keys:
            if not _is_flat_key(key):
                raise _Refused(f"a {type(key).__name__} as a key")
        return keys

    def _target(self, kinds: tuple[type, ...], what: str) -> Any:
        target = self.stack[-1]
        if type(target) not in kinds:
            raise _Refused(f"{what} into a {type(target).__name__}")
        return target

    def load_reduce(self) -> None:
        args = self._flat_args(self.stack.pop(), "a call")
        self._charge(1)
        self.stack[-1] = self.stack[-1](*args)

    def load_newobj(self) -> None:
        args = self._flat_args(self.stack.pop(), "a new object")
        cls = self.stack.pop()
        if not isinstance(cls, type):
            raise _Refused(f"a new object of a {type(cls).__name__}, not of a class")
        self._charge(1)
        self.append(cls.__new__(cls, *args))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        kind = type(inst)
        setstate = kind.__dict__.get("__setstate__") if kind in _BUILDABLE else None
        if setstate is not None and type(state) is tuple and len(state) <= _MAX_SETSTATE_FIELDS:
            self._charge(len(state) + 1)
            setstate(inst, state)  # the class's own (TensorProperties'), never one a stream planted
            return
        if kind not in _BUILDABLE or type(state) is not dict or not all(type(k) is str for k in state):
            raise _Refused(f"a {type(state).__name__} state for a {kind.__name__}")
        self._charge(len(state) + 1)
        inst.__dict__.update(state)

    def _append_tuple(self, items: Any) -> None:
        depth = 1
        for item in items:
            if type(item) is tuple:
                known = self._tuple_depths.get(id(item))
                depth = max(depth, 1 + (known[1] if known is not None and known[0] is item else 1))
        if depth > _MAX_TUPLE_DEPTH:
            raise _Refused(f"tuples nested more than {_MAX_TUPLE_DEPTH} deep")
        made = tuple(items)
        self._tuple_depths[id(made)] = (made, depth)
        self.append(made)

    def load_tuple(self) -> None:
        self._append_tuple(self.pop_mark())

    def load_tuple1(self) -> None:
        self._append_tuple((self.stack.pop(),))

    def load_tuple2(self) -> None:
        second = self.stack.pop()
        self._append_tuple((self.stack.pop(), second))

    def load_tuple3(self) -> None:
        third = self.stack.pop()
        second = self.stack.pop()
        self._append_tuple((self.stack.pop(), second, third))

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target((list,), "an append").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target((list,), "appends").extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        (key,) = self._flat_keys((self.stack.pop(),))
        self._target((dict, collections.OrderedDict), "an item")[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target((dict, collections.OrderedDict), "items")
        target.update(zip(self._flat_keys(items[0::2]), items[1::2]))

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.append(dict(zip(self._flat_keys(items[0::2]), items[1::2])))

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._target((set,), "set items").update(self._flat_keys(items))

    def load_frozenset(self) -> None:
        self.append(frozenset(self._flat_keys(self.pop_mark())))

    def load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        self.append(bytearray(self.read(n)))  # the read is checked against the bytes left first

    def refuse_opcode(self) -> None:
        raise _Refused("an opcode DCP metadata never uses (keyword construction, old-style instances, "
                       "persistent ids)")

    for _code, _load in ((pickle.REDUCE, load_reduce), (pickle.NEWOBJ, load_newobj), (pickle.BUILD, load_build),
                         (pickle.TUPLE, load_tuple), (pickle.TUPLE1, load_tuple1), (pickle.TUPLE2, load_tuple2),
                         (pickle.TUPLE3, load_tuple3), (pickle.APPEND, load_append), (pickle.APPENDS, load_appends),
                         (pickle.SETITEM, load_setitem), (pickle.SETITEMS, load_setitems), (pickle.DICT, load_dict),
                         (pickle.ADDITEMS, load_additems), (pickle.FROZENSET, load_frozenset),
                         (pickle.BYTEARRAY8, load_bytearray8), (pickle.NEWOBJ_EX, refuse_opcode),
                         (pickle.INST, refuse_opcode), (pickle.OBJ, refuse_opcode), (pickle.PERSID, refuse_opcode),
                         (pickle.BINPERSID, refuse_opcode)):
        dispatch[_code[0]] = _load
    del _code, _load


def load_metadata(data: bytes, path: str) -> Any:
    """The object the metadata pickle ``data`` (read from ``path``) holds; FormatError naming the
    file where it is refused or malformed.

    What reading it may cost is bounded by the file's size: a stream that declares more bytes than
    it holds, asks for more work than its size allows, or uses a nested key is refused first.
    """
    try:
        return _MetadataUnpickler(data).load()
    except _Refused as exc:
        raise FormatError(f"{path}: checkpoint metadata refused: {exc}") from None
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
        if planner is not None and not _is_planner_map(planner):
            raise _bad(path, "its planner data is not a map of item names to their paths")
    except AttributeError as exc:  # a field the file left out of an object it names
        raise _bad(path, str(exc)) from None
    return obj


def _shown(value: Any, depth: int = 2) -> str:
    """``value`` in a few words for an error message: never more than its first items and
    characters (a whole repr of what a hostile file holds can take gigabytes, or raise)."""
    kind = type(value)
    if value is None or kind is bool or kind is float:
        return repr(value)
    if kind is int:
        return repr(value) if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"
    if kind is str or kind is bytes:
        return repr(value[:_SHOWN_CHARS]) + ("..." if len(value) > _SHOWN_CHARS else "")
    if (kind is list or kind is tuple or kind is torch.Size) and depth > 0:
        inner = ", ".join(_shown(v, depth - 1) for v in value[:_SHOWN_ITEMS])
        more = ", ..." if len(value) > _SHOWN_ITEMS else ""
        return f"{kind.__name__}[{inner}{more}]" if kind is torch.Size else f"{kind.__name__}({inner}{more})"
    return f"a {kind.__name__}"


def _is_planner_map(planner: Any) -> bool:
    """Whether ``planner`` is what torch's planners store: item names to their paths in the state
    dict (tuples of keys and indices), flat, so that a planner using them hashes only flat keys."""
    if type(planner) is not dict:
        return False
    return all(type(k) is str and type(v) in (tuple, list) and all(type(p) in (str, int) for p in v)
               for k, v in planner.items())


def _bad(path: str, what: str) -> FormatError:
    return FormatError(f"{path}: not valid checkpoint metadata: {what}")


def _check_size(v: Any, fqn: str, what: str, path: str) -> None:
    if type(v) is not torch.Size or any(d < 0 for d in v):
        raise _bad(path, f"{_shown(fqn)}'s {what} is {_shown(v)}, not a size")


def _check_items(items: Any, path: str) -> None:
    if type(items) is not dict:
        raise _bad(path, "its items are not a dict")
    for fqn, item in items.items():
        if type(fqn) is not str:
            raise _bad(path, f"item name {_shown(fqn)} is not a string")
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata:
            raise _bad(path, f"{_shown(fqn)} is {type(item).__name__}")
        props = item.properties
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
            raise _bad(path, f"{_shown(fqn)}: tensor properties without a dtype")
        _check_size(item.size, fqn, "size", path)
        if type(item.chunks) is not list:
            raise _bad(path, f"{_shown(fqn)}: chunks are not a list")
        for chunk in item.chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise _bad(path, f"{_shown(fqn)}: a chunk is {type(chunk).__name__}")
            _check_size(chunk.offsets, fqn, "chunk offsets", path)
            _check_size(chunk.sizes, fqn, "chunk sizes", path)
            if len(chunk.offsets) != len(item.size) or len(chunk.sizes) != len(item.size) or any(
                    o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, item.size)):
                raise _bad(path, f"{_shown(fqn)}: a chunk lies outside the tensor's size {_shown(item.size)}")


def _check_storage(storage: Any, path: str) -> None:
    if storage is None:
        return
    if type(storage) is not dict:
        raise _bad(path, "its storage map is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise _bad(path, f"storage key {_shown(index)}")
        rel, offset, length = info.relative_path, info.offset, info.length
        if type(rel) is not str or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise _bad(path, f"the storage of {_shown(index.fqn)} is not a file, offset and length")
        parts = rel.replace("\\", "/").split("/")
        if not rel or rel.startswith("/") or ".." in parts or "\0" in rel:
            raise _bad(path, f"the storage of {_shown(index.fqn)} is in {_shown(rel)}, outside the checkpoint's directory")
