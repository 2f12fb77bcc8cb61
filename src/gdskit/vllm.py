"""vLLM's load format ``gdskit``: a model's weights read by gdskit straight into vLLM's parameters.

With gdskit installed beside vLLM, vLLM finds the load format through gdskit's
``vllm.general_plugins`` entry point (:func:`register`), in every process it starts:

    LLM(model="/path/to/checkpoint", load_format="gdskit")      # or vllm serve --load-format gdskit

:class:`GdskitModelLoader` reads a local safetensors checkpoint (a directory with its
index file, or with its ``*.safetensors`` files), or, with ``model_loader_extra_config=
{"weights": "s3://bucket/prefix/"}``, the weights under an object prefix (or another local
directory), while vLLM reads the config and tokenizer from the local ``model`` directory
(vLLM takes an object URL as ``model`` only for its own object-storage load formats). With the placement plan (``model_loader_extra_config={"placement": True}``;
:mod:`gdskit.formats.placement`), each tensor of a layer whose sharding it knows is read
straight into this rank's part of its (fused, sharded) parameter; every other tensor is
streamed with :func:`gdskit.safetensors.iter_tensors` onto the worker's GPU, within a memory
budget, and fed to the model's own ``load_weights``, which slices and copies it. It then logs
how many tensors and bytes took which way and how the bytes were read (the ledger's summary),
and refuses a model left with parameters the checkpoint did not fill, as vLLM's own loader
does. See docs/models.md.
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
from gdskit.engine import is_object_url, stats, stats_delta
from gdskit.formats.safetensors_format import resolve_checkpoint
from gdskit.formats.shard_index import index_checkpoint

try:
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
except ImportError as e:
    raise MissingDependencyError(f"gdskit.vllm needs vLLM (pip install vllm): {e}") from None

from gdskit.formats import placement_exec  # noqa: E402  (imports torch: after vLLM's check above)
from gdskit.formats.placement_exec import PlacementReport  # noqa: E402

__all__ = ["GdskitModelLoader", "register", "LOAD_FORMAT", "UninitializedWeightsError", "TiedHeadInCheckpointError",
           "PlacementReport", "last_report"]

#: Under vLLM's logger, so that the lines show where vLLM's own do, with its handlers and level.
_log = logging.getLogger("vllm.gdskit")

#: The name users pass as vLLM's ``load_format``.
LOAD_FORMAT = "gdskit"
#: What ``model_loader_extra_config`` may hold: ``max_inflight_bytes``, the most bytes of
#: tensors read ahead and not yet taken by the model (``iter_tensors``' budget; its default
#: when absent); ``placement``, True to read the placement plan's tensors straight into their
#: parameters (default False, every tensor through the model's ``load_weights``, until vLLM's
#: own engine has checked the plan on a GPU: docs/models.md); ``verify`` (``True`` or a manifest's
#: path: every tensor checked against its digest where it landed, before the model takes it;
#: docs/verify.md; not with ``placement`` yet); ``weights``, where the weights are when not in
#: the model's directory: an ``s3://`` prefix (with or without the last ``/``) or a local directory.
_EXTRA_KEYS = frozenset({"max_inflight_bytes", "placement", "verify", "weights"})
_PLACEMENT_DEFAULT = False


class UninitializedWeightsError(FormatError):
    """The checkpoint left some of the model's parameters unfilled."""


def _checkpoint_dir(model_config: Any) -> str:
    path = model_config.model
    if not isinstance(path, str) or not os.path.isdir(path):
        raise FormatError(f"{path}: the load format {LOAD_FORMAT!r} reads a local checkpoint directory; "
                          "download the model first (hf download <repo> --local-dir <dir>) and pass that directory, "
                          "or pass a local directory holding its config as the model and the weights' place as "
                          "model_loader_extra_config={'weights': 's3://bucket/prefix/'}")
    subfolder = getattr(model_config, "subfolder", None)
    return os.path.join(path, subfolder) if subfolder else path


def _weights_setting(extra: Any) -> str | None:
    """``weights`` from ``model_loader_extra_config`` (None: not given): an object prefix (ending
    in ``/``, added where missing) or a local directory's path; refused here if not a string."""
    value = extra.get("weights") if isinstance(extra, Mapping) else None
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise InvalidArgumentError(f"model_loader_extra_config: weights must be an s3:// prefix or a local "
                                   f"directory (a non-empty string), got {reprlib.repr(value)}")
    if is_object_url(value):
        return value if value.endswith("/") else value + "/"
    return value


def _weights_location(model_config: Any, weights: str | None) -> str:
    """Where the weights are read from: ``weights`` where given, else the model's directory."""
    if weights is None:
        return _checkpoint_dir(model_config)
    if not is_object_url(weights) and not os.path.isdir(weights):
        raise FormatError(f"{weights}: model_loader_extra_config's weights is neither an s3:// prefix nor a "
                          "local directory")
    return weights


def _weights_device(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters live: vLLM builds them on the worker's device before loading."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cuda", torch.cuda.current_device())


def _extra_settings(extra: Any) -> tuple[int | None, bool]:
    """``max_inflight_bytes`` (None: not given) and ``placement`` from vLLM's
    ``model_loader_extra_config``.

    vLLM passes the setting through unchecked (its type admits any object), so everything
    but a mapping of the keys in ``_EXTRA_KEYS`` is refused here; None means no extra config.
    """
    if extra is None:
        return None, _PLACEMENT_DEFAULT
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
    placement = extra.get("placement", _PLACEMENT_DEFAULT)
    if type(placement) is not bool:
        raise InvalidArgumentError(f"model_loader_extra_config: placement must be True or False, got {placement!r}")
    return budget, placement


def _verify_setting(extra: Any) -> Any:
    """``verify`` from ``model_loader_extra_config`` (False: not given); refused here if invalid."""
    from gdskit.verify import verify_mode  # noqa: PLC0415 - import time

    value = extra.get("verify", False) if isinstance(extra, Mapping) else False
    if verify_mode(value).whole_file:
        raise InvalidArgumentError("model_loader_extra_config: verify takes True or a manifest's path (the "
                                   "weights are streamed tensor by tensor, not checked as whole files)")
    return value


class GdskitModelLoader(BaseModelLoader):
    """vLLM's model loader for ``load_format="gdskit"``."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.max_inflight_bytes: int | None
        self.placement: bool
        self.max_inflight_bytes, self.placement = _extra_settings(load_config.model_loader_extra_config)
        self.verify: Any = _verify_setting(load_config.model_loader_extra_config)
        #: Where the weights are when not in the model's directory (None: they are there).
        self.weights: str | None = _weights_setting(load_config.model_loader_extra_config)
        if self.verify is not False and self.placement:
            raise InvalidArgumentError("model_loader_extra_config: verify is not taken with placement=True yet "
                                       "(placed tensors bypass the stream the checks run on)")
        #: How the last :meth:`load_weights` sent the tensors (None before the first).
        self.last_report: PlacementReport | None = None

    def download_model(self, model_config: Any) -> None:
        """Nothing to fetch: checks that the checkpoint is local, or that its object prefix
        lists its weights (the endpoint answers and the credentials work)."""
        path = _weights_location(model_config, self.weights)
        if is_object_url(path):
            resolve_checkpoint(path)

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        path = _weights_location(model_config, self.weights)
        if self.weights is not None:
            _refuse_a_head_vllm_would_untie(model, model_config, path)
        device = _weights_device(model)
        before, start = stats(), time.perf_counter()
        plan = None
        keys: list[str] | None = None  # None: every tensor goes to the model's load_weights
        if self.placement and getattr(model_config, "quantization", None) is None:
            index = index_checkpoint(path)
            plan, tensors = placement_exec.plan_model(model, index, _parallel_rank)
            if plan.placements:
                placement_exec.read_placements(plan, tensors, {p: h.file_size for p, h in index.headers})
                keys = [u.source for u in plan.uncovered]
        counted = _Counted()
        if keys == []:
            loaded = model.load_weights(iter(()))
        else:
            with gdskit.safetensors.iter_tensors(path, device, keys=keys, max_inflight_bytes=self.max_inflight_bytes,
                                                 verify=self.verify) as weights:
                loaded = model.load_weights(counted.through(weights))
        seconds = time.perf_counter() - start
        delta = stats_delta(before, stats())
        read = delta.bytes_read
        self.last_report = placement_exec.report(plan, counted.tensors, counted.nbytes)
        global _last_report
        _last_report = self.last_report
        _log.info("gdskit read %.2f GB of %s onto %s in %.2f s (%.1f GB/s)\n%s\n%s", read / 1e9, path, device,
                  seconds, read / 1e9 / seconds if seconds > 0 else 0.0, _which_way(self.last_report), delta.summary())
        if loaded is not None and getattr(model_config, "quantization", None) is None:
            placed = plan.placed_params if plan is not None else frozenset()
            _refuse_unfilled(model, set(loaded) | placed, path)


class TiedHeadInCheckpointError(FormatError):
    """The weights hold a tensor of a parameter the model ties to another (an LM head tied to
    the embeddings), which vLLM would have untied had it found the weights in the model's directory."""


def _refuse_a_head_vllm_would_untie(model: torch.nn.Module, model_config: Any, path: str) -> None:
    """vLLM (0.33 on) builds a tied model untied when the checkpoint in the model's directory
    holds the LM head (``ModelConfig.word_embeddings_untied_by_checkpoint``); with the weights
    elsewhere it cannot look, ties them, and the model's ``load_weights`` drops the head. Where
    the weights do hold a tied name, that would be another model than vLLM's own loader makes
    from the same checkpoint: refused. vLLM that never unties (no such attribute) drops the head
    either way."""
    if not hasattr(model_config, "word_embeddings_untied_by_checkpoint"):
        return
    aliases = placement_exec.tied_names(model)
    held = sorted(set(aliases) & set(index_checkpoint(path).tensors)) if aliases else []
    if held:
        raise TiedHeadInCheckpointError(
            f"{path} holds {', '.join(held)}, which the model built from {model_config.model} ties to another "
            "parameter; vLLM unties such a model only when the weights are in the model's directory. Set "
            f"tie_word_embeddings to false in {model_config.model}/config.json, or put the weights there")


def _parallel_rank() -> tuple[int, int]:
    """vLLM's tensor-parallel rank and size, for layers that do not keep their rank (vLLM 0.26's
    embeddings)."""
    from vllm.distributed import (get_tensor_model_parallel_rank,  # noqa: PLC0415 - optional dependency (vllm)
                                  get_tensor_model_parallel_world_size)  # noqa: PLC0415 - optional dependency (vllm)
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


class _Counted:
    """Counts the tensors (and their bytes) a stream hands the model."""

    def __init__(self) -> None:
        self.tensors = 0
        self.nbytes = 0

    def through(self, weights: Any) -> Any:
        for item in weights:
            self.tensors += 1
            self.nbytes += item[1].nbytes
            yield item
            del item  # before the next is read: the stream's budget counts tensors still referenced


def _which_way(r: PlacementReport) -> str:
    """The log's line on which way the tensors went."""
    if not r.planned:
        return (f"placement plan off: {r.fallback} tensors ({r.fallback_bytes / 1e9:.2f} GB) went through the "
                "model's load_weights")
    why = "; ".join(f"{n} x {reason}" for reason, n in r.reasons[:3])
    more = f" and {len(r.reasons) - 3} more reasons" if len(r.reasons) > 3 else ""
    return (f"placement plan: {r.placed} tensors ({r.placed_bytes / 1e9:.2f} GB read) straight into their "
            f"parameters, {r.fallback} tensors ({r.fallback_bytes / 1e9:.2f} GB) through the model's load_weights"
            + (f" ({why}{more})" if why else ""))


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
_last_report: PlacementReport | None = None


def last_report() -> PlacementReport | None:
    """How the last load in this process sent the tensors (None before the first): what a
    test or a tool asks the engine's worker process, through ``LLM.apply_model``."""
    return _last_report


def register() -> None:
    """Make ``load_format="gdskit"`` known to vLLM (the ``vllm.general_plugins`` entry point;
    vLLM calls it in each of its processes). Calling it again does nothing."""
    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(GdskitModelLoader)
        _registered = True
