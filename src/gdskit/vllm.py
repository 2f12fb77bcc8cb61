"""vLLM's load format ``gdskit``: a model's weights read by gdskit and handed to vLLM one by one.

With gdskit installed beside vLLM, vLLM finds the load format through gdskit's
``vllm.general_plugins`` entry point (:func:`register`), in every process it starts:

    LLM(model="/path/to/checkpoint", load_format="gdskit")      # or vllm serve --load-format gdskit

:class:`GdskitModelLoader` streams a local safetensors checkpoint (a directory with its
index file, or with its ``*.safetensors`` files) with :func:`gdskit.safetensors.iter_tensors`
straight onto the worker's GPU, within a memory budget, and feeds the tensors to the model's
own ``load_weights``, which slices them for tensor parallelism and copies them into its
parameters. It then logs how the bytes were read (the ledger's summary) and refuses a model
left with parameters the checkpoint did not fill, as vLLM's own loader does. See
docs/models.md.
"""

from __future__ import annotations

import logging
import os
import reprlib
import time
from collections.abc import Mapping
from typing import Any

import gdskit.safetensors
from gdskit.errors import FormatError, InvalidArgumentError, MissingDependencyError
from gdskit.engine import stats, stats_delta

try:
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
except ImportError as e:
    raise MissingDependencyError(f"gdskit.vllm needs vLLM (pip install vllm): {e}") from None

__all__ = ["GdskitModelLoader", "register", "LOAD_FORMAT", "UninitializedWeightsError"]

#: Under vLLM's logger, so that the lines show where vLLM's own do, with its handlers and level.
_log = logging.getLogger("vllm.gdskit")

#: The name users pass as vLLM's ``load_format``.
LOAD_FORMAT = "gdskit"
#: What ``model_loader_extra_config`` may hold: ``max_inflight_bytes``, the most bytes of
#: tensors read ahead and not yet taken by the model (``iter_tensors``' budget; its default
#: when absent), and ``verify`` (``True`` or a manifest's path: every tensor checked against
#: its digest where it landed, before the model takes it; docs/verify.md).
_EXTRA_KEYS = frozenset({"max_inflight_bytes", "verify"})


class UninitializedWeightsError(FormatError):
    """The checkpoint left some of the model's parameters unfilled."""


def _checkpoint_dir(model_config: Any) -> str:
    path = model_config.model
    if not os.path.isdir(path):
        raise FormatError(f"{path}: the load format {LOAD_FORMAT!r} reads a local checkpoint directory; "
                          "download the model first (hf download <repo> --local-dir <dir>) and pass that directory")
    subfolder = getattr(model_config, "subfolder", None)
    return os.path.join(path, subfolder) if subfolder else path


def _weights_device(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters live: vLLM builds them on the worker's device before loading."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cuda", torch.cuda.current_device())


def _inflight_budget(extra: Any) -> int | None:
    """``max_inflight_bytes`` from vLLM's ``model_loader_extra_config`` (None: not given).

    vLLM passes the setting through unchecked (its type admits any object), so everything
    but a mapping of the keys in ``_EXTRA_KEYS`` is refused here; None means no extra config.
    """
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError(f"model_loader_extra_config must be a mapping (such as "
                                   f"{{'max_inflight_bytes': 2 << 30}}) for the load format {LOAD_FORMAT!r}, "
                                   f"not {type(extra).__name__} {reprlib.repr(extra)}")
    unknown = sorted(map(repr, set(extra) - _EXTRA_KEYS))  # repr: keys of any type, sorted together
    if unknown:
        raise InvalidArgumentError(f"model_loader_extra_config: unknown keys {', '.join(unknown)} for the load "
                                   f"format {LOAD_FORMAT!r} (it takes {sorted(_EXTRA_KEYS)})")
    budget = extra.get("max_inflight_bytes")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise InvalidArgumentError(f"model_loader_extra_config: max_inflight_bytes must be a positive "
                                   f"integer, got {budget!r}")
    return budget


def _verify_setting(extra: Any) -> Any:
    """``verify`` from ``model_loader_extra_config`` (False: not given); refused here if invalid."""
    from gdskit.formats.verified import verify_mode  # noqa: PLC0415 - import time

    value = extra.get("verify", False) if isinstance(extra, Mapping) else False
    if verify_mode(value).kind == "sha256":
        raise InvalidArgumentError("model_loader_extra_config: verify takes True or a manifest's path (the "
                                   "weights are streamed tensor by tensor, not checked as whole files)")
    return value


class GdskitModelLoader(BaseModelLoader):
    """vLLM's model loader for ``load_format="gdskit"``."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.max_inflight_bytes: int | None = _inflight_budget(load_config.model_loader_extra_config)
        self.verify: Any = _verify_setting(load_config.model_loader_extra_config)

    def download_model(self, model_config: Any) -> None:
        _checkpoint_dir(model_config)  # nothing to fetch: only checks that the checkpoint is local

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        path = _checkpoint_dir(model_config)
        device = _weights_device(model)
        before, start = stats(), time.perf_counter()
        with gdskit.safetensors.iter_tensors(path, device, max_inflight_bytes=self.max_inflight_bytes,
                                             verify=self.verify) as weights:
            loaded = model.load_weights(weights)
        seconds = time.perf_counter() - start
        delta = stats_delta(before, stats())
        read = delta.bytes_read
        _log.info("gdskit read %.2f GB of %s onto %s in %.2f s (%.1f GB/s)\n%s", read / 1e9, path, device, seconds,
                  read / 1e9 / seconds if seconds > 0 else 0.0, delta.summary())
        if loaded is not None and getattr(model_config, "quantization", None) is None:
            _refuse_unfilled(model, set(loaded), path)


def _refuse_unfilled(model: torch.nn.Module, loaded: set[str], path: str) -> None:
    """Raise if a parameter was not filled, leaving out those vLLM's own loader leaves out:
    the parameters of modules whose quantization method makes or processes them after
    loading (scales a checkpoint need not hold)."""
    expected = {name for name, _ in model.named_parameters()}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "uses_meta_device", False) or getattr(method, "process_weights_after_loading", None):
            loaded.update(f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters())
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise UninitializedWeightsError(f"{path}: {len(missing)} of the model's parameters are not in the "
                                        f"checkpoint: {shown}")


_registered = False


def register() -> None:
    """Make ``load_format="gdskit"`` known to vLLM (the ``vllm.general_plugins`` entry point;
    vLLM calls it in each of its processes). Calling it again does nothing."""
    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(GdskitModelLoader)
        _registered = True
