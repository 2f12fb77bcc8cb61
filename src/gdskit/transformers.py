"""Hugging Face transformers models, built without their weights and filled in place by gdskit.

>>> import gdskit.transformers
>>> model = gdskit.transformers.load_model("path/to/checkpoint", device="cuda:0")

:func:`load_model` does what ``from_pretrained(path).to(device)`` does, with the bytes read
by :func:`gdskit.safetensors.load_into`: the model is built from ``config.json`` on the meta
device (no memory, no random initialisation), its tensors are made once on ``device``, and
the checkpoint's bytes land straight in them. Needs transformers 5
(``pip install 'gdskit[transformers]'``). See docs/models.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

from gdskit.engine import is_object_url, list_objects, open_file
from gdskit.errors import FormatError, GdskitError, InvalidArgumentError, MissingDependencyError
from gdskit.formats import require_torch, through_resident
from gdskit.formats.into_plan import key_mismatch

__all__ = ["load_model", "UnsupportedModelError"]

_log = logging.getLogger("gdskit.transformers")

#: Checkpoint names a model tolerates beyond its own lists, as from_pretrained does: rotary
#: frequencies and position ids that older checkpoints stored as persistent buffers.
_TOLERATED_UNEXPECTED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


#: Start the engine's set-up for the read (pinned stages, streams, worker threads:
#: ``gdskit.prepare``) as soon as the checkpoint's headers are read, in the background, so that
#: it runs while the model is built on the meta device and its tensors are made, not after.
EARLY_WARM_UP = True


class UnsupportedModelError(GdskitError, NotImplementedError):
    """The model needs a loading step :func:`load_model` does not take (quantized weights,
    modules kept in float32 under a half-precision dtype)."""


#: What brings torch and transformers 5 both.
_INSTALL_HINT = "pip install 'gdskit[transformers]'"


def _dependencies() -> tuple[Any, Any]:
    """torch and transformers (5 or later); :class:`MissingDependencyError` with the install hint
    where either is missing."""
    try:
        torch = require_torch("gdskit.transformers")
    except MissingDependencyError:
        raise MissingDependencyError(f"gdskit.transformers needs torch: {_INSTALL_HINT}") from None
    try:
        import transformers  # noqa: PLC0415 - optional dependency (transformers)
    except ImportError:
        raise MissingDependencyError(f"gdskit.transformers needs transformers: {_INSTALL_HINT}") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise MissingDependencyError(f"gdskit.transformers needs transformers 5 or later "
                                     f"(this is {transformers.__version__}): {_INSTALL_HINT}")
    return torch, transformers


_dependencies()  # at import, as every torch-facing module of gdskit fails without what it needs


#: The files of a checkpoint that transformers reads itself (not the weights): copied from an object
#: prefix into a private temporary directory for it.
_CONFIG_FILES = ("config.json", "generation_config.json")
#: The largest of those an object prefix may hold: a config is kilobytes.
_MAX_CONFIG_BYTES = 16 << 20
_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")


def _objects_under(prefix: str) -> dict[str, tuple[str, int]]:
    """The objects directly under the URL ``prefix`` (a ``/`` is added), by name: (url, size)."""
    prefix = prefix if prefix.endswith("/") else prefix + "/"
    found = {}
    for url, size in list_objects(prefix):
        name = url[len(prefix):]
        if "/" not in name:
            found[name] = (url, size)
    return found


def _checkpoint_files(path: str) -> str:
    """The safetensors weights of checkpoint directory (or object prefix) ``path``: its index
    file, or its one file."""
    if is_object_url(path):
        objects = _objects_under(path)
        for name in _WEIGHT_FILES:
            if name in objects:
                return objects[name][0]
        raise FormatError(f"{path}: no model.safetensors or model.safetensors.index.json under this prefix")
    if not os.path.isdir(path):
        raise FormatError(f"{path}: not a checkpoint directory (with config.json and model.safetensors)")
    for name in ("model.safetensors.index.json", "model.safetensors"):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            return full
    raise FormatError(f"{path}: no model.safetensors or model.safetensors.index.json (gdskit reads "
                      "safetensors checkpoints; save with save_pretrained(safe_serialization=True))")


@contextlib.contextmanager
def _config_directory(path: str) -> Iterator[str]:
    """Where transformers reads the checkpoint's config from: ``path`` itself, or for an object
    prefix a private temporary directory (made by ``mkdtemp``: mode 0700, a random name) holding
    a copy of its config files, removed on exit."""
    if not is_object_url(path):
        yield path
        return
    objects = _objects_under(path)
    if "config.json" not in objects:
        raise FormatError(f"{path}: no config.json under this prefix (a save_pretrained directory holds one)")
    with tempfile.TemporaryDirectory(prefix="gdskit-config-") as local:
        for name in _CONFIG_FILES:
            if name not in objects:
                continue
            url, size = objects[name]
            if size > _MAX_CONFIG_BYTES:
                raise FormatError(f"{url}: {size} bytes is not a config file (at most {_MAX_CONFIG_BYTES})")
            data = bytearray(size)
            with open_file(url) as f:
                got = f.read(data, size, 0)
            if got != size:
                raise FormatError(f"{url}: {got} bytes read where the listing said {size}")
            with open(os.path.join(local, name), "xb") as out:  # a new file in our own directory
                out.write(data)
        yield local


def _model_class(transformers: Any, config: Any, model_class: Any) -> Any:
    if model_class is not None:
        return model_class
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def _dtype_arg(torch: Any, name: str, value: Any) -> Any:
    """``value`` of argument ``name`` as from_pretrained reads it: a torch.dtype, or None for ``"auto"``."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value == "auto":
        return None
    found = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise InvalidArgumentError(f"{name} must be a torch.dtype, a dtype's name or 'auto', not {value!r}")
    return found


def _chosen_dtype(torch: Any, dtype: Any, torch_dtype: Any) -> Any:
    """The dtype asked for by ``dtype`` (transformers 5's name) or ``torch_dtype`` (the older
    one): a torch.dtype, or None for ``"auto"``; both given must name the same."""
    given = {name: _dtype_arg(torch, name, value)
             for name, value in (("dtype", dtype), ("torch_dtype", torch_dtype)) if value is not None}
    if len(set(given.values())) > 1:
        raise InvalidArgumentError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} differ: give one of them "
                                   "(dtype is transformers 5's name for torch_dtype)")
    return next(iter(given.values()), None)


def _resolve_dtype(torch: Any, config: Any, chosen: Any, index: Any) -> Any:
    """``chosen`` (from :func:`_chosen_dtype`), or where it is None (``"auto"``), as
    from_pretrained's default: the config's dtype, else the checkpoint's first floating-point
    tensor's, else torch's default."""
    if chosen is not None:
        return chosen
    dt = getattr(config, "dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    if isinstance(dt, torch.dtype):
        return dt
    from gdskit import safetensors as gs  # noqa: PLC0415 - import time
    for loc in index.tensors.values():
        cand, _shape = gs._torch_type(torch, loc.entry)
        if cand.is_floating_point:
            return cand
    return torch.get_default_dtype()


def _build_on_meta(transformers: Any, torch: Any, cls: Any, config: Any, dtype: Any) -> Any:
    """The model with every tensor on the meta device, built as from_pretrained builds it, but
    with torch's initialisers switched off while it is built (transformers' own
    ``no_init_weights``): on the meta device they compute nothing, and cost a third of the
    build."""
    try:  # a submodule the package does not import by itself
        init = importlib.import_module("transformers.initialization")
    except ImportError:
        init = None
    safe_ops = getattr(init, "meta_device_safe_creation_ops", None)  # models that call .item() in __init__
    no_init = getattr(init, "no_init_weights", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.device("meta"))
        if safe_ops is not None:
            stack.enter_context(safe_ops())
        if no_init is not None:
            stack.enter_context(no_init())
        if hasattr(cls, "_model_mapping"):  # an Auto class
            return cls.from_config(config, dtype=dtype)
        return cls._from_config(config, dtype=dtype)


def _materialise(torch: Any, model: Any, device: Any) -> None:
    """``model.to_empty(device=device)``, with each tensor made once: a tensor two modules
    share (tied weights) is one allocation, not one per module; the large ones come out of
    one allocator block (``reserve_device_memory``), not a ``cudaMalloc`` each.

    Every tensor is replaced by a new one (a parameter by a new ``Parameter``), as ``to_empty``
    replaces them between devices; a shared one by one new tensor. Where torch is told to swap or overwrite module parameters on conversion
    (``torch.__future__``), or a tensor is a subclass, ``to_empty`` itself runs.
    """
    from gdskit.formats.device_memory import reserve_device_memory  # noqa: PLC0415 - import time

    fut = torch.__future__
    modules = list(model.modules())
    plain = (torch.Tensor, torch.nn.Parameter)
    if (fut.get_swap_module_params_on_conversion() or fut.get_overwrite_module_params_on_conversion()
            or any(type(t) not in plain for m in modules
                   for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)):
        model.to_empty(device=device)
        return
    unique: dict[int, Any] = {}
    for m in modules:
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                unique.setdefault(id(t), t)
    reserve_device_memory(device, [t.numel() * t.element_size() for t in unique.values()])
    made: dict[int, Any] = {}

    def empty(t: Any) -> Any:
        new = made.get(id(t))
        if new is None:  # to_empty's empty_like, without its way through the meta device's Python
            new = (torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_contiguous()
                   else torch.empty_like(t, device=device))
            if isinstance(t, torch.nn.Parameter):  # a new Parameter, as to_empty makes one across devices
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return new

    with torch.no_grad():
        for m in modules:
            for group in (m._parameters, m._buffers):
                for key, t in group.items():
                    if t is not None:
                        group[key] = empty(t)


def _checkpoint_names(model: Any, names: set[str], params: dict[str, Any]) -> dict[str, str]:
    """The checkpoint's name for each of the model's tensors: a base model loaded from a
    checkpoint of a model with a head finds its tensors prefixed there (``bert.``), and a
    model with a head loaded from a base model's checkpoint the other way round."""
    same = {k: k for k in params}
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or any(k in names for k in params):
        return same
    lead = prefix + "."
    if any(n.startswith(lead) for n in names) and not any(k.startswith(lead) for k in params):
        return {k: lead + k for k in params}
    if any(k.startswith(lead) for k in params):
        return {k: k[len(lead):] if k.startswith(lead) else k for k in params}
    return same


def _tolerated(patterns: Any, extra: tuple[str, ...] = ()) -> re.Pattern[str] | None:
    found = list(patterns or ()) + list(extra)
    return re.compile("|".join(f"({p})" for p in found)) if found else None


def load_model(path: str | os.PathLike[str], device: Any = "cuda:0", *, model_class: Any = None,
               dtype: Any = None, torch_dtype: Any = None, strict: bool = True, verify: Any = False) -> Any:
    """Build a transformers model from the checkpoint directory ``path`` and fill it on ``device``.

    Parameters
    ----------
    path : path or str
        A directory written by ``save_pretrained``: ``config.json`` and ``model.safetensors``
        or shards with their ``model.safetensors.index.json``; or an object prefix holding the
        same (``s3://bucket/models/llama/``, docs/object-storage.md).
    device : str, int or torch.device
        Where the model's tensors are made (``"cpu"`` works too).
    model_class : class, optional
        A model class (``LlamaForCausalLM``) or an Auto class; default: the config's
        first ``architectures`` entry, else ``AutoModel``.
    dtype : torch.dtype, str or None
        As ``from_pretrained(dtype=...)``; None means ``"auto"`` (the config's dtype), as
        there. Checkpoint tensors of another dtype are converted on ``device``.
    torch_dtype : torch.dtype, str or None
        The older name of ``dtype``; given with it, it must name the same dtype
        (else :class:`~gdskit.errors.InvalidArgumentError`).
    strict : bool
        True: checkpoint names that do not pair with the model's (beyond what the model
        itself tolerates, and tied weights) raise :class:`gdskit.safetensors.KeyMismatchError`.
        False: missing weights are initialised as from_pretrained initialises them, and
        the names are logged.
    verify : bool, str or path
        Check every checkpoint tensor's bytes where they landed, as
        :func:`gdskit.safetensors.load_into` does (docs/verify.md).

    Returns
    -------
    transformers.PreTrainedModel
        In eval mode, weights tied, with its generation config where the directory has one.
    """
    torch, transformers = _dependencies()
    from gdskit import safetensors as gs  # noqa: PLC0415 - import time
    from gdskit.formats.shard_index import index_checkpoint  # noqa: PLC0415 - import time

    chosen = _chosen_dtype(torch, dtype, torch_dtype)  # before anything is read
    from gdskit.verify import verify_mode  # noqa: PLC0415 - import time

    verifying = verify_mode(verify).on  # a bad value is refused before the model is built
    path = os.fspath(path)
    weights = _checkpoint_files(path)
    index = index_checkpoint(weights)  # every header checked before the model is built
    # A model class names its config class, as from_pretrained reads it (one Auto does not know of,
    # say); the Auto classes and the default go through AutoConfig.
    config_class = getattr(model_class, "config_class", None) if not hasattr(model_class, "_model_mapping") else None
    with _config_directory(path) as config_dir:
        config = (config_class or transformers.AutoConfig).from_pretrained(config_dir)
        generation_config = (transformers.GenerationConfig.from_pretrained(config_dir)
                             if os.path.isfile(os.path.join(config_dir, "generation_config.json")) else None)
    if getattr(config, "quantization_config", None) is not None:
        raise UnsupportedModelError(f"{path}: quantized checkpoints are not supported; use from_pretrained")
    dtype = _resolve_dtype(torch, config, chosen, index)
    dev = gs._device(torch, device)
    sizes = [loc.entry.nbytes for loc in index.tensors.values()]
    # load_into's own reads wait for the warm-up, or find it done; none where the resident loader
    # (gdskit serve) will read them, whose staging is warm already.
    if EARLY_WARM_UP and dev.type == "cuda" and (verifying or not through_resident.worth_asking(
            torch, dev, sizes, [p for p, _h in index.headers])):
        from gdskit.engine import start_warm_up  # noqa: PLC0415 - import time

        start_warm_up(dev.index, sum(sizes))
    model = _build_on_meta(transformers, torch, _model_class(transformers, config, model_class), config, dtype)
    plan_fn = getattr(model, "_get_dtype_plan", None)
    if plan_fn is not None and plan_fn(dtype):
        raise UnsupportedModelError(f"{type(model).__name__} keeps some modules in float32 under {dtype}; "
                                    "load it with from_pretrained, or in float32")

    _materialise(torch, model, dev)
    model.tie_weights()  # tied parameters are one tensor: load_into fills it once
    from gdskit.formats.into_exec import load_safetensors_into, module_state  # noqa: PLC0415 - import time

    params = module_state(model)
    renamed = _checkpoint_names(model, set(index.tensors), params)
    target = {renamed[k]: v for k, v in params.items()}
    result = load_safetensors_into(target, weights, torch_type=gs._torch_type, shape=gs._READ_SHAPE, strict=False,
                                   cast=True, progress=None, return_stats=False, index=index, verify=verify)
    model_name = {v: k for k, v in renamed.items()}
    not_loaded = [model_name[k] for k in result.missing_keys]  # in the model's own names
    missing_ok = _tolerated(getattr(model, "_keys_to_ignore_on_load_missing", None))
    unexpected_ok = _tolerated(getattr(model, "_keys_to_ignore_on_load_unexpected", None), _TOLERATED_UNEXPECTED)
    missing = [k for k in not_loaded if missing_ok is None or not missing_ok.search(k)]
    unexpected = [k for k in result.unexpected_keys if unexpected_ok is None or not unexpected_ok.search(k)]
    if strict and (missing or unexpected):
        raise key_mismatch(missing, unexpected)
    if missing or unexpected:
        _log.warning("%s: %d weights not in the checkpoint (initialised): %s; %d checkpoint tensors unused: %s",
                     path, len(missing), missing[:8], len(unexpected), unexpected[:8])

    # What from_pretrained does after its reads: tensors that were loaded are marked so that
    # the model's own initialisation leaves them be; it then sets what the checkpoint does not
    # hold (non-persistent buffers such as rotary frequencies and position ids, which to_empty
    # left uninitialised, and any missing weight).
    skip = set(not_loaded)
    for name, t in params.items():
        if name not in skip:
            t._is_hf_initialized = True
    model.initialize_weights()
    model.tie_weights()
    model.eval()
    if model.can_generate() and generation_config is not None:
        model.generation_config = generation_config
    return model


def __dir__() -> list[str]:
    return sorted(__all__)  # the API and its errors; the module's own imports are not part of it
