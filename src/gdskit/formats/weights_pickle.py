"""A fast ``weights_only`` unpickler for the pickles of plain state dicts.

torch's weights-only unpickler (``torch._weights_only_unpickler``) is written in
Python and interprets every opcode itself; for a checkpoint of 20,000 small tensors
that took most of a load (1.4 of 1.8 s on the development VM). This module hands such
pickles to Python's C unpickler instead, and makes it decide exactly as torch's would:
the same objects built for a pickle torch accepts, and :class:`NotPlain` — before any
object is built — for everything else, which the caller then gives, whole, to torch's
unpickler (which accepts or refuses it on its own rules, the user's
``torch.serialization.add_safe_globals`` included).

How, in three steps:

1. A scan of the opcode stream (regular expressions, at C speed) admits only the opcodes
   torch.save writes for state dicts, all of them ones torch's unpickler knows, starting
   with ``PROTO 2``: no INST / OBJ / NEWOBJ / NEWOBJ_EX, no extension codes, no
   STACK_GLOBAL, FRAME, MEMOIZE, DUP, POP, text or bytes opcodes, PERSID. GLOBAL may
   name only the short list below, byte for byte. The memo indices of LONG_BINPUT are
   bounded by the pickle's size (the C unpickler sizes its memo by the largest one, and
   torch.save numbers them from 0, one per PUT).
2. The opcodes whose C meaning differs from torch's are rewritten to hand their
   operands to Python, where torch's rule is applied: BUILD (the C unpickler calls
   ``__setstate__`` or ``setattr`` on any object, functions and classes included; torch
   allows only OrderedDict, Tensor and Parameter; here only an OrderedDict given a dict,
   as torch.save writes ``_metadata``), SETITEM / SETITEMS (C: anything with
   ``__setitem__``, lists and tensors too; torch: dicts), APPEND / APPENDS (C: anything
   with ``append``; torch: lists). Each becomes a call of ``persistent_load`` with a
   tuple that ends in a marker object only this module's GLOBAL names can produce (and
   the scan lets no such name through from the file). BINPERSID stays, with torch's
   check of the id.
3. The C unpickler runs the rewritten stream with ``find_class`` limited to the short
   list, each name also on torch's own weights-only list: ``OrderedDict``, the tensor
   and parameter rebuild functions, ``torch.Size``, dtypes, ``UntypedStorage`` and the
   legacy storage type names. REDUCE therefore only ever calls one of these (no other
   object built from them is callable) with a tuple, as torch's does.

Anything the C unpickler then raises — a value that does not fit a rebuild function,
an unhashable key — is :class:`NotPlain` too: torch's unpickler gives the verdict.
Until then only fresh objects were touched, so running it again changes nothing.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gdskit.errors import GdskitError

__all__ = ["NotPlain", "load", "scan"]


class NotPlain(Exception):
    """The pickle needs more than the plain state-dict vocabulary: use torch's unpickler."""


# -- the vocabulary -------------------------------------------------------------------

_PLAIN_NAMES = ("collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
                "torch._utils._rebuild_parameter", "torch.Size", "torch.storage.UntypedStorage")


class _Op:
    """What one rewritten opcode does, with torch's rule; its instances are the markers."""

    __slots__ = ("name", "apply")

    def __init__(self, name: str, apply: Callable[[Any, Any], Any]) -> None:
        self.name, self.apply = name, apply


def _build(inst: Any, state: Any) -> Any:
    # torch: ``type(inst) is OrderedDict`` -> ``inst.__dict__.update(state)``. Tensor and
    # Parameter states (and any other) are left to torch's unpickler.
    if type(inst) is not OrderedDict or type(state) is not dict:
        raise NotPlain("BUILD of something other than an OrderedDict's attributes")
    inst.__dict__.update(state)
    return inst


def _setitem(target: Any, pair: tuple[Any, Any]) -> Any:
    if type(target) is not dict and type(target) is not OrderedDict:
        raise NotPlain("SETITEM on something other than a dict")
    target[pair[0]] = pair[1]
    return target


def _setitems(target: Any, items: tuple[Any, ...]) -> Any:
    if type(target) is not dict and type(target) is not OrderedDict:
        raise NotPlain("SETITEMS on something other than a dict")
    if len(items) % 2:
        raise NotPlain("SETITEMS with an odd number of items")
    target.update(zip(items[::2], items[1::2]))  # item by item, in order, as torch's loop
    return target


def _append(target: Any, item: Any) -> Any:
    if type(target) is not list:
        raise NotPlain("APPEND to something other than a list")
    target.append(item)
    return target


def _appends(target: Any, items: tuple[Any, ...]) -> Any:
    if type(target) is not list:
        raise NotPlain("APPENDS to something other than a list")
    target.extend(items)
    return target


_MARKER_MODULE = "gdskit.formats.weights_pickle"
_OPS = {"BUILD": _build, "SETITEM": _setitem, "SETITEMS": _setitems, "APPEND": _append, "APPENDS": _appends}


def _marker(name: str) -> bytes:
    return b"c" + _MARKER_MODULE.encode() + b"\n" + name.encode() + b"\n"


# opcode -> what replaces it. Stack before -> the tuple persistent_load receives:
#   BUILD     inst state          -> (inst, state, marker)
#   SETITEM   target key value    -> (target, (key, value), marker)
#   SETITEMS  target MARK items   -> (target, items, marker)
#   APPEND    target item         -> (target, item, marker)
#   APPENDS   target MARK items   -> (target, items, marker)
# Each leaves the target on the stack, as the opcode does.
_REWRITE = {
    pickle.BUILD[0]: _marker("BUILD") + pickle.TUPLE3 + pickle.BINPERSID,
    pickle.SETITEM[0]: pickle.TUPLE2 + _marker("SETITEM") + pickle.TUPLE3 + pickle.BINPERSID,
    pickle.SETITEMS[0]: pickle.TUPLE + _marker("SETITEMS") + pickle.TUPLE3 + pickle.BINPERSID,
    pickle.APPEND[0]: _marker("APPEND") + pickle.TUPLE3 + pickle.BINPERSID,
    pickle.APPENDS[0]: pickle.TUPLE + _marker("APPENDS") + pickle.TUPLE3 + pickle.BINPERSID,
}


class _Vocabulary:
    """The globals plain state dicts name, the markers, and the scanners that admit them."""

    def __init__(self, plain: dict[tuple[str, str], Any]) -> None:
        self.plain = plain
        self.lookup = dict(plain)
        self.lookup.update({(_MARKER_MODULE, name): _Op(name, fn) for name, fn in _OPS.items()})
        self._globals = b"c(?:" + b"|".join(
            re.escape(f"{m}\n{n}\n".encode()) for m, n in sorted(plain, key=lambda k: (k[0] != "torch", k))) + b")"

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one vocabulary per process)
    def tokens(self, tier: int) -> re.Pattern[bytes]:
        """Runs of admitted tokens, LONG_BINPUT indices below ``(tier + 1) << 16``."""
        return _token_pattern(self._globals, tier)


def _token_pattern(globals_: bytes, tier: int) -> re.Pattern[bytes]:
    """One regular expression that matches as long a run of admitted opcodes as it can.

    Every alternative is a concatenation of whole tokens, so a match ends on a token
    boundary; where it stops, :func:`scan` looks at the next opcode itself (the rewritten
    ones, STOP, strings of 256 bytes or more, integers of more than 8, anything refused).
    The scan of the 2.4 MB pickle of 20,000 tensors took about 10 ms of CPU on the
    development VM; the tensor template below saves about a sixth of it.
    """
    def count(n: int) -> bytes:
        return b"" if n == 0 else b"." if n == 1 else b".{%d}" % n

    put = b"(?:q.|r..[\\x00-" + re.escape(bytes([tier])) + b"]\\x00)"  # BINPUT, LONG_BINPUT (bounded)
    get = b"(?:h.|j....)"                                              # BINGET, LONG_BINGET
    int_ = b"(?:K.|M..|J....)"                                         # BININT1, BININT2, BININT
    def string(longest: int) -> bytes:  # BINUNICODE of up to ``longest`` bytes: one alternative per
        # length, each starting with a literal byte (which the matcher skips over cheaply)
        return b"X(?:" + b"|".join(re.escape(bytes([n, 0, 0, 0])) + count(n) for n in range(longest + 1)) + b")"

    long1 = b"\\x8a(?:" + b"|".join(re.escape(bytes([n])) + count(n) for n in range(9)) + b")"  # up to 64 bits
    # MARK ( EMPTY_TUPLE ) EMPTY_LIST ] EMPTY_DICT } TUPLE t TUPLE1-3 NONE N NEWTRUE
    # NEWFALSE REDUCE R BINPERSID Q
    one_byte = b"[" + b"".join(re.escape(bytes([c])) for c in b"()]}t\x85\x86\x87N\x88\x89RQ") + b"]"
    token = b"|".join([b"[hKq].", put, string(255), get, int_, b"G.{8}", globals_, long1])
    # A tensor as torch.save writes it, its key first: only a faster path to the same tokens
    # (its strings short, to keep the expression small: longer ones take the path above).
    ref = b"(?:" + get + b"|" + globals_ + put + b")"
    str_ref = b"(?:" + string(15) + put + b"|" + get + b")"
    ints = b"(?:\\)|" + int_ + b"\\x85|" + int_ + int_ + b"\\x86|" + int_ * 3 + b"\\x87|\\((?:" + int_ + \
        b")*+t" + b")" + put + b"?"
    tensor = (ref + b"\\(\\(" + str_ref + ref + str_ref + str_ref + int_ + b"t" + put + b"?Q" + int_ + ints + ints +
              b"[\\x88\\x89]" + ref + b"\\)R" + put + b"?(?:" + ref + b")?t" + put + b"?R" + put + b"?")
    key = string(127) + put
    run = b"(?:" + key + tensor + b"|" + one_byte + b"*+(?:" + token + b"))*+" + one_byte + b"*+"
    return re.compile(run, re.DOTALL)


@functools.lru_cache(maxsize=1)
def _vocabulary() -> _Vocabulary | None:
    """The short list, each name checked against torch's own weights-only list (a name
    torch does not allow, or would read as another, is left out); None where this torch
    has no such list or not the objects this module was written against."""
    import torch  # noqa: PLC0415 - optional dependency (torch)
    try:
        from torch import _weights_only_unpickler as wo  # noqa: PLC0415 - optional dependency (torch)
        allowed = wo._get_allowed_globals()
    except (ImportError, AttributeError):
        return None
    renamed = getattr(torch._utils, "NAME_MAPPING", {})
    renamed_modules = getattr(torch._utils, "IMPORT_MAPPING", {})
    wanted = set(_PLAIN_NAMES)
    wanted.update(key for key, obj in allowed.items() if isinstance(obj, torch.dtype))  # torch.float32, ...
    wanted.update(key for key in allowed if key.startswith("torch.") and key.endswith("Storage")
                  and key.count(".") == 1)  # legacy storage names: torch.FloatStorage, ...
    plain: dict[tuple[str, str], Any] = {}
    for key in wanted:
        module, _, name = key.rpartition(".")
        if key in allowed and (module, name) not in renamed and module not in renamed_modules \
                and "\n" not in key:
            plain[(module, name)] = allowed[key]
    if plain.get(("collections", "OrderedDict")) is not OrderedDict or \
            hasattr(OrderedDict(), "__setstate__"):
        return None
    return _Vocabulary(plain)


# -- the scan ---------------------------------------------------------------------------

def _tier(size: int) -> int:
    """The smallest of 0, 1, 3, ..., 255 with ``(tier + 1) << 16`` above half of ``size``:
    a pickle's memo indices count its PUT opcodes, each at least two bytes."""
    tier = 0
    while (tier + 1) << 17 <= size and tier < 255:
        tier = tier * 2 + 1
    return tier


def scan(data: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """Check that ``data`` uses only the plain vocabulary; :class:`NotPlain` if not.

    Returns the opcodes to rewrite (position, replacement) and the position of STOP.
    """
    vocab = _vocabulary()
    if vocab is None:
        raise NotPlain("no plain vocabulary for this torch")
    if data[:2] != b"\x80\x02":
        raise NotPlain("not a protocol 2 pickle")
    match = vocab.tokens(_tier(len(data))).match
    rewrites: list[tuple[int, bytes]] = []
    end = len(data)
    pos = 2
    while True:
        pos = match(data, pos).end()  # type: ignore[union-attr]  (a run may be empty: it always matches)
        if pos >= end:
            raise NotPlain("no STOP")
        op = data[pos]
        replacement = _REWRITE.get(op)
        if replacement is not None:
            rewrites.append((pos, replacement))
            pos += 1
        elif op == pickle.STOP[0]:
            return rewrites, pos
        elif op == pickle.BINUNICODE[0] and pos + 5 <= end:  # 256 bytes or more
            pos += 5 + int.from_bytes(data[pos + 1:pos + 5], "little")
        elif op == pickle.LONG1[0] and pos + 2 <= end:  # more than 8 bytes
            pos += 2 + data[pos + 1]
        else:
            raise NotPlain(f"opcode {bytes([op])!r} at {pos}")


def _rewritten(data: bytes, rewrites: list[tuple[int, bytes]], stop: int) -> bytes:
    view = memoryview(data)
    pieces: list[Any] = []
    last = 0
    for pos, replacement in rewrites:
        pieces += (view[last:pos], replacement)
        last = pos + 1
    pieces.append(view[last:stop + 1])
    return b"".join(pieces)


# -- the unpickle -------------------------------------------------------------------------

class _PlainUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, lookup: dict[tuple[str, str], Any],
                 storage: Callable[[Any], Any]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._lookup = lookup

        def persistent_load(pid: Any) -> Any:
            if type(pid) is tuple:
                if len(pid) == 5:
                    if type(pid[0]) is str and pid[0] == "storage":
                        return storage(pid)
                elif len(pid) == 3 and type(pid[2]) is _Op:  # one of the rewritten opcodes
                    return pid[2].apply(pid[0], pid[1])
            raise NotPlain("a persistent id that is not a storage's")

        self.persistent_load = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        found = self._lookup.get((module, name))
        if found is None:
            raise NotPlain(f"{module}.{name}")
        return found


def load(data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
    """Unpickle ``data`` if it uses only the plain state-dict vocabulary; else raise :class:`NotPlain`.

    gdskit's own errors from ``persistent_load`` (a missing or truncated record) pass
    through. ``persistent_load`` may be called again for the same ids by the fallback.
    """
    rewrites, stop = scan(data)
    vocab = _vocabulary()
    assert vocab is not None
    up = _PlainUnpickler(_rewritten(data, rewrites, stop), vocab.lookup, persistent_load)
    try:
        return up.load()
    except (NotPlain, GdskitError):
        raise
    except Exception as exc:  # a value the short list cannot build: torch's unpickler decides
        raise NotPlain(f"{type(exc).__name__}: {exc}") from None
