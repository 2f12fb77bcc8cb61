"""A fast ``weights_only`` unpickler for the pickles of plain state dicts.

torch's weights-only unpickler (``torch._weights_only_unpickler``) is written in
Python and interprets every opcode itself; for a checkpoint of 20,000 small tensors
that took most of a load (1.4 of 1.8 s on the development VM). Plain state dicts
only ever name a handful of globals: ``OrderedDict``, the tensor and parameter
rebuild functions, ``torch.Size``, dtypes, ``UntypedStorage`` and the legacy storage
type names. This module runs Python's C unpickler with ``find_class`` limited to
exactly those objects, each one also allowed by torch's own weights-only list.

Why that is as safe: a pickle can only create objects and call functions that a
global lookup handed it, and every lookup here answers from the short list above or
stops. Calling those objects builds tensors, parameters, storages, dicts and sizes,
and none of these results is callable at all: no code the file names can run. Anything
else (another global, an object the C unpickler cannot build from these) raises
:class:`NotPlain`, and the caller hands the whole pickle to torch's weights-only
unpickler, which then accepts or refuses it on its own rules (including the user's
``torch.serialization.add_safe_globals``).
"""

from __future__ import annotations

import functools
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gdskit.errors import GdskitError


class NotPlain(Exception):
    """The pickle needs more than the plain state-dict vocabulary: use torch's unpickler."""


@functools.lru_cache(maxsize=1)
def _plain_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for the globals plain state dicts name; each one checked
    against torch's own weights-only list (a name torch does not allow is left out)."""
    import torch
    try:
        from torch import _weights_only_unpickler as wo
        allowed = wo._get_allowed_globals()
    except (ImportError, AttributeError):  # a torch without the list: always use its unpickler
        return {}
    wanted = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
              "torch._utils._rebuild_parameter", "torch.Size", "torch.storage.UntypedStorage"}
    wanted.update(key for key, obj in allowed.items() if isinstance(obj, torch.dtype))  # torch.float32, ...
    wanted.update(key for key in allowed if key.startswith("torch.") and key.endswith("Storage")
                  and key.count(".") == 1)  # legacy storage names: torch.FloatStorage, ...
    out: dict[tuple[str, str], Any] = {}
    for key in wanted:
        if key in allowed:
            module, _, name = key.rpartition(".")
            out[(module, name)] = allowed[key]
    if out.get(("collections", "OrderedDict")) is not OrderedDict:
        return {}  # not the torch this module was written against: always use torch's unpickler
    return out


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _plain_globals().get((module, name))
        if found is None:
            raise NotPlain(f"{module}.{name}")
        return found


def load(data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
    """Unpickle ``data`` if it uses only the plain state-dict vocabulary; else raise :class:`NotPlain`.

    gdskit's own errors from ``persistent_load`` (a missing or truncated record) pass
    through. ``persistent_load`` may be called again for the same ids by the fallback.
    """
    if not _plain_globals():
        raise NotPlain("no plain vocabulary for this torch")
    up = _PlainUnpickler(io.BytesIO(data), encoding="utf-8")
    up.persistent_load = persistent_load
    try:
        return up.load()
    except (NotPlain, GdskitError):
        raise
    except Exception as exc:  # anything the short list cannot build: torch's unpickler decides
        raise NotPlain(f"{type(exc).__name__}: {exc}") from None
