"""The model families the vLLM placement plan places (Llama, Mistral, Qwen2, Qwen3): each
one's shapes as a ``vllm_llama_shapes.Cfg``, its model of stand-in layers, and a checkpoint
written as save_pretrained writes one (two shards and their index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import torch as safetensors_torch

from vllm_llama_shapes import Cfg

#: Each family's shapes, as its vLLM model builds them: Qwen2 has q/k/v biases and no head_dim
#: of its own (hidden / heads), Qwen3 per-head norms of q and k. 4 heads of 8, 2 KV heads: at 4
#: ranks each KV head is on two ranks.
FAMILIES = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
}


def family_cfg(family: str, tied: bool) -> Cfg:
    return Cfg(hidden=32, heads=4, kv_heads=2, head_size=8, v_head_size=8, intermediate=48, vocab=100, tied=tied,
               dtype="BF16", layers=2, **FAMILIES[family])


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Two shards and their index, as save_pretrained writes them."""
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors_torch.save_file({n: tensors[n] for n in part}, root / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


#: Mistral's own checkpoint format: its names for the transformers names of vllm_llama_shapes.
_MISTRAL_NAMES = (("model.embed_tokens.", "tok_embeddings."), ("model.layers.", "layers."),
                  ("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                  ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                  ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm"),
                  ("mlp.gate_proj", "feed_forward.w1"), ("mlp.down_proj", "feed_forward.w2"),
                  ("mlp.up_proj", "feed_forward.w3"), ("model.norm.", "norm."), ("lm_head.", "output."))


def mistral_format(tensors: dict[str, torch.Tensor], cfg: Cfg) -> dict[str, torch.Tensor]:
    """``tensors`` (transformers' names and layout) as Mistral's own format holds them: its names,
    and q's and k's rows in Mistral's rotary layout (the inverse of the permutation vLLM's
    Mistral applies when it loads them)."""
    out = {}
    for name, t in tensors.items():
        for hf, ours in _MISTRAL_NAMES:
            name = name.replace(hf, ours)
        heads = {"wq": cfg.heads, "wk": cfg.kv_heads}.get(name.split(".")[-2])
        if heads is not None:
            rows, cols = t.shape
            t = t.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)
        out[name] = t
    return out


def fake_model(family: str, cfg: Cfg, rank: int, tp: int):
    import vllm_fake_layers as fake

    cls = {"llama": fake.LlamaForCausalLM, "mistral": fake.MistralForCausalLM, "qwen2": fake.Qwen2ForCausalLM,
           "qwen3": fake.Qwen3ForCausalLM}[family]
    return cls(cfg, rank, tp)
