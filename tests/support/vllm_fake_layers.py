"""A small vLLM-shaped model for CI: modules named as vLLM's layers and carrying the
attributes vLLM's layers carry (those gdskit.formats.placement_exec reads, and nothing
read from elsewhere), each with a weight loader that narrows and copies as vLLM's does.

The model's ``load_weights`` maps names as vLLM's Llama does (``q_proj`` -> ``qkv_proj``
with shard ``"q"``, ``gate_proj`` -> ``gate_up_proj`` with shard 0, ...), skips
``rotary_emb.inv_freq`` and, with tied embeddings, ``lm_head.*`` (and, as vLLM 0.33, raises
where it skipped ``lm_head.weight`` but was not given the embedding it is tied to), and
returns the names it filled. Every parameter starts as the fill pattern of :func:`vllm_shard_rules.garbage`.
"""

from __future__ import annotations

import torch
from torch import nn

import vllm_shard_rules as rules


class UnquantizedLinearMethod:
    pass


class UnquantizedEmbeddingMethod:
    pass


class Fp8LinearMethod:
    pass


def _param(shape, dtype, loader, **attrs) -> nn.Parameter:
    p = nn.Parameter(rules.garbage(tuple(shape), dtype), requires_grad=False)
    p.weight_loader = loader
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class _Linear(nn.Module):
    def __init__(self, rows: int, cols: int, dtype, rank: int, tp: int, bias: bool = False, method=None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = rank, tp
        self.quant_method = (method or UnquantizedLinearMethod)()
        self.weight = _param((rows, cols), dtype, self.weight_loader, output_dim=0, input_dim=1)
        if bias:
            self.bias = _param((rows,), dtype, self.weight_loader, output_dim=0)


class ColumnParallelLinear(_Linear):
    def __init__(self, inp: int, out: int, dtype, rank: int, tp: int, **kw) -> None:
        super().__init__(out // tp, inp, dtype, rank, tp, **kw)

    def weight_loader(self, param, loaded):
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))


class RowParallelLinear(_Linear):
    def __init__(self, inp: int, out: int, dtype, rank: int, tp: int) -> None:
        super().__init__(out, inp // tp, dtype, rank, tp)

    def weight_loader(self, param, loaded):
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))


class QKVParallelLinear(_Linear):
    def __init__(self, hidden: int, head_size: int, heads: int, kv_heads: int, dtype, rank: int, tp: int,
                 bias: bool = False) -> None:
        self.head_size = self.v_head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = heads, kv_heads
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = rules.kv_layout(heads, kv_heads, tp)
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_size
        super().__init__(rows, hidden, dtype, rank, tp, bias=bias)

    def weight_loader(self, param, loaded, shard):
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        slot, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        owner = self.tp_rank if shard == "q" else self.tp_rank // self.num_kv_head_replicas
        param.data.narrow(0, slot, size).copy_(loaded.narrow(0, owner * size, size))


class MergedColumnParallelLinear(_Linear):
    def __init__(self, inp: int, sizes: list[int], dtype, rank: int, tp: int) -> None:
        self.output_sizes = list(sizes)
        super().__init__(sum(sizes) // tp, inp, dtype, rank, tp)

    def weight_loader(self, param, loaded, shard):
        size = self.output_sizes[shard] // self.tp_size
        slot = sum(self.output_sizes[:shard]) // self.tp_size
        param.data.narrow(0, slot, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype, rank: int, tp: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = rank, tp
        self.org_vocab_size = self.num_embeddings = vocab
        self.padding_size = rules.PAD
        self.num_embeddings_per_partition = per_rank = rules.padded_vocab(vocab) // tp
        start, end = min(rank * per_rank, vocab), min(rank * per_rank + per_rank, vocab)
        self.shard_indices = type("ShardIndices", (), {"org_vocab_start_index": start, "org_vocab_end_index": end})()
        self.quant_method = UnquantizedEmbeddingMethod()
        self.weight = _param((per_rank, hidden), dtype, self.weight_loader, output_dim=0, input_dim=1)

    def weight_loader(self, param, loaded):
        s = self.shard_indices
        n = s.org_vocab_end_index - s.org_vocab_start_index
        param.data[:n].copy_(loaded.narrow(0, s.org_vocab_start_index, n))
        param.data[n:].fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    pass


def default_weight_loader(param, loaded):
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(rules.garbage((hidden,), dtype), requires_grad=False)


class LlamaForCausalLM(nn.Module):
    """vLLM's Llama at rank ``rank`` of ``tp``, from a ``tests/test_vllm_placement.Cfg``."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    _stacked = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))

    def __init__(self, cfg, rank: int, tp: int, dtype=torch.bfloat16, o_proj_method=None) -> None:
        super().__init__()
        self.tied = cfg.tied
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab, cfg.hidden, dtype, rank, tp)
        self.model.layers = nn.ModuleList()
        for _ in range(cfg.layers):
            layer = nn.Module()
            layer.input_layernorm = RMSNorm(cfg.hidden, dtype)
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = QKVParallelLinear(cfg.hidden, cfg.head_size, cfg.heads, cfg.kv_heads, dtype,
                                                         rank, tp, bias=cfg.qkv_bias)
            if cfg.qk_norm:  # Qwen3's per-head norms
                layer.self_attn.q_norm = RMSNorm(cfg.head_size, dtype)
                layer.self_attn.k_norm = RMSNorm(cfg.head_size, dtype)
            if o_proj_method is None:
                layer.self_attn.o_proj = RowParallelLinear(cfg.heads * cfg.head_size, cfg.hidden, dtype, rank, tp)
            else:  # a layer of another quantization method: left to load_weights
                layer.self_attn.o_proj = RowParallelLinear(cfg.heads * cfg.head_size, cfg.hidden, dtype, rank, tp)
                layer.self_attn.o_proj.quant_method = o_proj_method()
            layer.post_attention_layernorm = RMSNorm(cfg.hidden, dtype)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = MergedColumnParallelLinear(cfg.hidden, [cfg.intermediate] * 2, dtype, rank, tp)
            layer.mlp.down_proj = RowParallelLinear(cfg.intermediate, cfg.hidden, dtype, rank, tp)
            self.model.layers.append(layer)
        self.model.norm = RMSNorm(cfg.hidden, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab, cfg.hidden, dtype, rank, tp)
        if cfg.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        skipped_alias = False
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tied and name.startswith("lm_head."):
                skipped_alias = True
                continue
            for fused, piece, shard in self._stacked:
                if piece in name:
                    name = name.replace(piece, fused)
                    params[name].weight_loader(params[name], tensor, shard)
                    break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        if skipped_alias and "model.embed_tokens.weight" not in loaded:
            # vLLM 0.33's AutoWeightsLoader: a tied name skipped whose parameter this call never loaded
            raise ValueError("lm_head.weight was skipped because it is tied to model.embed_tokens.weight, "
                             "which was not loaded")
        return loaded


class OtherForCausalLM(LlamaForCausalLM):
    """The same layers under a model class the plan does not know."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """vLLM's Qwen2: Llama's layers and names, with q/k/v biases (``Cfg.qkv_bias``)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """vLLM's Qwen3: Llama's layers and names, with per-head q/k norms (``Cfg.qk_norm``)."""


class MistralForCausalLM(LlamaForCausalLM):
    """vLLM's Mistral: Llama's, and it also takes Mistral's own checkpoint names
    (``layers.0.attention.wq.weight``), renamed and with q's and k's rows permuted from
    Mistral's rotary layout (pairs of rows interleaved) to the halves transformers keeps."""

    _own_names = (("tok_embeddings.", "model.embed_tokens."), ("layers.", "model.layers."),
                  ("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
                  ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
                  ("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                  ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w2", "mlp.down_proj"),
                  ("feed_forward.w3", "mlp.up_proj"), ("norm.", "model.norm."), ("output.", "lm_head."))

    def __init__(self, cfg, rank: int, tp: int, dtype=torch.bfloat16, **kw) -> None:
        super().__init__(cfg, rank, tp, dtype, **kw)
        self.cfg = cfg

    def _from_own_format(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name.startswith(("model.", "lm_head.")):
            return name, tensor
        heads = {"wq": self.cfg.heads, "wk": self.cfg.kv_heads}.get(name.split(".")[-2])
        if heads is not None and name.endswith(".weight"):
            rows, cols = tensor.shape
            tensor = tensor.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
        for own, hf in self._own_names:
            if name.startswith(own) or f".{own}" in name:
                name = name.replace(own, hf, 1) if name.startswith(own) else name.replace(f".{own}", f".{hf}", 1)
        return name, tensor

    def load_weights(self, weights):
        return super().load_weights(self._from_own_format(n, t) for n, t in weights)
