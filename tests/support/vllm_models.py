"""vLLM's own model classes (Llama, Mistral, Qwen2, Qwen3) built on the CPU at any
tensor-parallel rank, as the reference for the placement plan and the load format.

Only where vLLM is installed. The model is vLLM's: its config comes from a config.json
through vLLM's ``EngineArgs``, its class from vLLM's registry, its layers, parameters, weight
loaders and ``load_weights`` are vLLM's. Three things are set up around it so that it can be
built here, in one process, without a GPU:

- the platform is vLLM's ``CpuPlatform`` (a CUDA build of vLLM finds no platform on a machine
  without a GPU);
- a process group of one rank (gloo) stands behind vLLM's parallel state;
- :func:`at_rank` answers ``get_tensor_model_parallel_rank``/``_world_size`` with the rank and
  size asked for, in every vLLM module that imported those names, while the model is built
  and loaded (as tests/support/vllm_reference.py does for single layers).

Every parameter starts as the fill pattern of ``vllm_shard_rules.garbage`` (0xA5 bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

_RANK_FUNCS = ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size")
_state: dict[str, Any] = {}


def _cpu_platform() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if not isinstance(platforms._current_platform, CpuPlatform):
        platforms._current_platform = CpuPlatform()


@contextlib.contextmanager
def at_rank(rank: int, tp: int) -> Iterator[None]:
    """vLLM's layers, models and gdskit's loader see rank ``rank`` of ``tp``."""
    fakes = {_RANK_FUNCS[0]: lambda *a, **k: rank, _RANK_FUNCS[1]: lambda *a, **k: tp}
    saved = []
    for name, module in list(sys.modules.items()):
        if not (name == "vllm" or name.startswith("vllm.")) or name == "vllm.distributed.parallel_state":
            continue
        for attr, fake in fakes.items():
            if callable(getattr(module, attr, None)):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, fake)
    try:
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def engine_config(config_dir: Path | str, dtype: torch.dtype, load_format: str = "safetensors",
                  extra: dict[str, Any] | None = None) -> Any:
    """vLLM's whole config for the model in ``config_dir`` (one rank; :func:`at_rank` fakes others).
    Not ``load_format="dummy"``: vLLM unties a tied model whose checkpoint holds an LM head only
    for formats that read a checkpoint."""
    _cpu_platform()
    from vllm.engine.arg_utils import EngineArgs

    if load_format == "gdskit":
        import gdskit.vllm

        gdskit.vllm.register()  # what vLLM's plugin loading does where gdskit is installed
    name = str(dtype).removeprefix("torch.")
    return EngineArgs(model=str(config_dir), load_format=load_format, dtype=name, enforce_eager=True,
                      skip_tokenizer_init=True, max_model_len=64,
                      model_loader_extra_config=extra or {}).create_engine_config()


def _process_group(vc: Any) -> None:
    if _state.get("group"):
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    port = 29500 + os.getpid() % 2000
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
    _state["group"] = True


def build(config_dir: Path, rank: int, tp: int, dtype: torch.dtype, load_format: str = "safetensors",
          extra: dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    """vLLM's model for ``config_dir`` at ``rank`` of ``tp``, its parameters filled with 0xA5;
    and its ``ModelConfig``."""
    vc = engine_config(config_dir, dtype, load_format, extra)
    _process_group(vc)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vc), at_rank(rank, tp), set_default_torch_dtype(dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=vc)
    for p in model.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    return model, vc.model_config


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def weights(model: nn.Module) -> dict[str, bytes]:
    return {n: raw(p) for n, p in model.named_parameters()}


def vllm_loaded(config_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]], rank: int, tp: int,
                dtype: torch.dtype) -> tuple[nn.Module, dict[str, bytes]]:
    """vLLM's model after its own ``load_weights`` took ``tensors`` (in that order)."""
    model, _ = build(config_dir, rank, tp, dtype)
    with at_rank(rank, tp):
        model.load_weights(iter(list(tensors)))
    return model, weights(model)


def gdskit_loaded(config_dir: Path, weights_path: str, rank: int, tp: int, dtype: torch.dtype,
                  extra: dict[str, Any]) -> tuple[nn.Module, dict[str, bytes], Any]:
    """vLLM's model after gdskit's load format read ``weights_path`` into it (``extra``: the
    ``model_loader_extra_config``); and the loader's report."""
    from vllm.config.load import LoadConfig

    import gdskit.vllm as gv

    model, model_config = build(config_dir, rank, tp, dtype, "gdskit", extra)
    loader = gv.GdskitModelLoader(LoadConfig(load_format="gdskit", model_loader_extra_config=extra))
    with at_rank(rank, tp):
        loader.download_model(model_config)
        loader.load_weights(model, model_config)
    return model, weights(model), loader.last_report


def write_config(root: Path, family: str, *, tied: bool, heads: int = 8, kv_heads: int = 2, head_size: int = 8,
                 hidden: int = 32, intermediate: int = 48, vocab: int = 100, layers: int = 2) -> Path:
    """A config.json of ``family`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``) in ``root``."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[family]
    config = {"architectures": [arch], "model_type": family, "vocab_size": vocab, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_size, "intermediate_size": intermediate, "max_position_embeddings": 64,
              "tie_word_embeddings": tied, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
              "torch_dtype": "bfloat16"}
    if family == "qwen3":
        config["attention_bias"] = False
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root
