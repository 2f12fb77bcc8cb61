"""A Llama-shaped checkpoint (as transformers names its tensors) and the parameters vLLM's
Llama holds at each tensor-parallel rank: their facts for the placement plan, and their
bytes as the stand-in of vLLM's loaders (tests/vllm_shard_rules.py) makes them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

import vllm_shard_rules as rules
from gdskit.formats.placement import LayerKind, ParamFacts, QKVHeads, VocabSplit

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Cfg:
    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    v_head_size: int
    intermediate: int
    vocab: int
    tied: bool
    dtype: str
    qkv_bias: bool = False
    layers: int = 1
    qk_norm: bool = False  # Qwen3's per-head RMSNorms of q and k (``self_attn.q_norm``/``k_norm``)


def checkpoint(cfg: Cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, as transformers names them."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[cfg.dtype]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt)

    h, hs, vhs = cfg.hidden, cfg.head_size, cfg.v_head_size
    out = {"model.embed_tokens.weight": rand(cfg.vocab, h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = rand(h)
        out[p + "self_attn.q_proj.weight"] = rand(cfg.heads * hs, h)
        out[p + "self_attn.k_proj.weight"] = rand(cfg.kv_heads * hs, h)
        out[p + "self_attn.v_proj.weight"] = rand(cfg.kv_heads * vhs, h)
        if cfg.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = rand(cfg.heads * hs)
            out[p + "self_attn.k_proj.bias"] = rand(cfg.kv_heads * hs)
            out[p + "self_attn.v_proj.bias"] = rand(cfg.kv_heads * vhs)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = rand(hs)
            out[p + "self_attn.k_norm.weight"] = rand(hs)
        out[p + "self_attn.o_proj.weight"] = rand(h, cfg.heads * vhs)
        out[p + "post_attention_layernorm.weight"] = rand(h)
        out[p + "mlp.gate_proj.weight"] = rand(cfg.intermediate, h)
        out[p + "mlp.up_proj.weight"] = rand(cfg.intermediate, h)
        out[p + "mlp.down_proj.weight"] = rand(h, cfg.intermediate)
    out["model.norm.weight"] = rand(h)
    if not cfg.tied:
        out["lm_head.weight"] = rand(cfg.vocab, h)
    return out


def facts(cfg: Cfg, rank: int, tp: int) -> dict[str, ParamFacts]:
    """The parameters vLLM's Llama holds at ``rank`` of ``tp`` (a tied LM head is the embedding's
    parameter, listed once under its first name, as ``named_parameters`` lists it)."""
    nh, nkv, _ = rules.kv_layout(cfg.heads, cfg.kv_heads, tp)
    h, hs, vhs = cfg.hidden, cfg.head_size, cfg.v_head_size
    heads = QKVHeads(cfg.heads, cfg.kv_heads, hs, vhs)
    vocab = VocabSplit(cfg.vocab, cfg.vocab)
    per_rank = rules.padded_vocab(cfg.vocab) // tp
    qkv_rows = nh * hs + nkv * hs + nkv * vhs

    def f(name: str, kind: LayerKind, shape: tuple[int, ...], **kw) -> tuple[str, ParamFacts]:
        return name, ParamFacts(name, kind, shape, cfg.dtype, rank, tp, **kw)

    out = dict([f("model.embed_tokens.weight", LayerKind.VOCAB, (per_rank, h), output_dim=0, input_dim=1,
                  vocab=vocab)])
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out.update([
            f(p + "input_layernorm.weight", LayerKind.REPLICATED, (h,)),
            f(p + "self_attn.qkv_proj.weight", LayerKind.QKV, (qkv_rows, h), output_dim=0, input_dim=1, heads=heads),
            f(p + "self_attn.o_proj.weight", LayerKind.ROW, (h, cfg.heads * vhs // tp), output_dim=0, input_dim=1),
            f(p + "post_attention_layernorm.weight", LayerKind.REPLICATED, (h,)),
            f(p + "mlp.gate_up_proj.weight", LayerKind.MERGED_COLUMN, (2 * cfg.intermediate // tp, h), output_dim=0,
              input_dim=1, output_sizes=(cfg.intermediate, cfg.intermediate)),
            f(p + "mlp.down_proj.weight", LayerKind.ROW, (h, cfg.intermediate // tp), output_dim=0, input_dim=1),
        ])
        if cfg.qkv_bias:
            out.update([f(p + "self_attn.qkv_proj.bias", LayerKind.QKV, (qkv_rows,), output_dim=0, heads=heads)])
        if cfg.qk_norm:
            out.update([f(p + "self_attn.q_norm.weight", LayerKind.REPLICATED, (hs,)),
                        f(p + "self_attn.k_norm.weight", LayerKind.REPLICATED, (hs,))])
    out.update([f("model.norm.weight", LayerKind.REPLICATED, (h,))])
    if not cfg.tied:
        out.update([f("lm_head.weight", LayerKind.VOCAB, (per_rank, h), output_dim=0, input_dim=1, vocab=vocab)])
    return out


def expected(full: dict[str, torch.Tensor], cfg: Cfg, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The parameters the stand-in of vLLM's loaders makes at ``rank`` of ``tp``."""
    out = {"model.embed_tokens.weight": rules.vocab(full["model.embed_tokens.weight"], rank, tp)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = rules.replicated(full[p + "input_layernorm.weight"])
        for part in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[a + "qkv_proj." + part] = rules.qkv(full[a + "q_proj." + part], full[a + "k_proj." + part],
                                                    full[a + "v_proj." + part], rank, tp, cfg.heads, cfg.kv_heads,
                                                    cfg.head_size, cfg.v_head_size)
        out[a + "o_proj.weight"] = rules.row(full[a + "o_proj.weight"], rank, tp)
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = rules.replicated(full[a + "q_norm.weight"])
            out[a + "k_norm.weight"] = rules.replicated(full[a + "k_norm.weight"])
        out[p + "post_attention_layernorm.weight"] = rules.replicated(full[p + "post_attention_layernorm.weight"])
        out[p + "mlp.gate_up_proj.weight"] = rules.merged([full[p + "mlp.gate_proj.weight"],
                                                          full[p + "mlp.up_proj.weight"]], rank, tp)
        out[p + "mlp.down_proj.weight"] = rules.row(full[p + "mlp.down_proj.weight"], rank, tp)
    out["model.norm.weight"] = rules.replicated(full["model.norm.weight"])
    if not cfg.tied:
        out["lm_head.weight"] = rules.vocab(full["lm_head.weight"], rank, tp)
    return out


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def save_checkpoint(directory: Path, cfg: Cfg, extra: dict | None = None, drop: str | None = None) -> Path:
    """``checkpoint(cfg)`` (with ``extra`` tensors added and ``drop`` left out) in ``directory``
    as ``save_pretrained`` writes it: two shards and an index; the directory."""
    from safetensors.torch import save_file

    tensors = checkpoint(cfg)
    tensors.update(extra or {})
    tensors.pop(drop, None)
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, directory / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory
