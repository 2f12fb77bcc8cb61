"""vLLM's own layers on the CPU, as the reference for tests/vllm_shard_rules.py and the plan.

Only where vLLM is installed. vLLM's linear and vocabulary-parallel layers ask
``get_tensor_model_parallel_rank``/``_world_size`` for their rank when they are built (and
their parameters, for the rank their loaders slice at); :func:`at_rank` answers for them in
the modules that imported those functions, so that any rank of any size can be built in one
process without a process group. Everything else is vLLM's: the layers' ``__init__``, their
parameters' classes and attributes, and their weight loaders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_RANK_FUNCS = ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size")


@contextlib.contextmanager
def at_rank(rank: int, tp: int) -> Iterator[None]:
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    saved = []
    for module in (linear, vocab, parameter):
        for name, value in zip(_RANK_FUNCS, (lambda: rank, lambda: tp)):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class LlamaForCausalLM(nn.Module):
    """One decoder layer's linear layers and the embeddings, built of vLLM's own classes, with
    the names vLLM's Llama gives them; and a replicated layer (``router``)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_size: int, intermediate: int, vocab: int,
                 qkv_bias: bool) -> None:
        from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                       ReplicatedLinear, RowParallelLinear)
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(vocab, hidden)
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = QKVParallelLinear(hidden, head_size, heads, kv_heads, bias=qkv_bias)
        layer.self_attn.o_proj = RowParallelLinear(heads * head_size, hidden, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=False)
        layer.mlp.down_proj = RowParallelLinear(intermediate, hidden, bias=False)
        layer.router = ReplicatedLinear(hidden, 8, bias=True)  # not Llama's: a replicated layer to check
        self.model.layers = nn.ModuleList([layer])
        self.lm_head = ParallelLMHead(vocab, hidden)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """As vLLM's Llama maps names onto its parameters and calls their weight loaders."""
        params = dict(self.named_parameters())
        stacked = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                   (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
        for name, tensor in weights.items():
            for fused, piece, shard in stacked:
                if piece in name:
                    p = params[name.replace(piece, fused)]
                    p.weight_loader(p, tensor, shard)
                    break
            else:
                params[name].weight_loader(params[name], tensor)


def checkpoint(hidden: int, heads: int, kv_heads: int, head_size: int, intermediate: int, vocab: int,
               qkv_bias: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    out = {"model.embed_tokens.weight": rand(vocab, hidden),
           a + "q_proj.weight": rand(heads * head_size, hidden), a + "k_proj.weight": rand(kv_heads * head_size, hidden),
           a + "v_proj.weight": rand(kv_heads * head_size, hidden), a + "o_proj.weight": rand(hidden, heads * head_size),
           m + "gate_proj.weight": rand(intermediate, hidden), m + "up_proj.weight": rand(intermediate, hidden),
           m + "down_proj.weight": rand(hidden, intermediate), "lm_head.weight": rand(vocab, hidden),
           "model.layers.0.router.weight": rand(8, hidden), "model.layers.0.router.bias": rand(8)}
    if qkv_bias:
        out.update({a + "q_proj.bias": rand(heads * head_size), a + "k_proj.bias": rand(kv_heads * head_size),
                    a + "v_proj.bias": rand(kv_heads * head_size)})
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def build(rank: int, tp: int, dtype: torch.dtype, **shape: int) -> LlamaForCausalLM:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with at_rank(rank, tp):
            model = LlamaForCausalLM(**shape)
    finally:
        torch.set_default_dtype(before)
    for p in model.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    return model


def vllm_loaded(full: dict[str, torch.Tensor], rank: int, tp: int, dtype: torch.dtype, **shape) -> dict[str, bytes]:
    """Every parameter's bytes after vLLM's own weight loaders took ``full``."""
    model = build(rank, tp, dtype, **shape)
    with at_rank(rank, tp):
        model.load_weights(full)
    return {n: raw(p) for n, p in model.named_parameters()}


def stand_in_loaded(rules, full: dict[str, torch.Tensor], rank: int, tp: int, heads: int, kv_heads: int,
                    head_size: int, qkv_bias: bool, **_: int) -> dict[str, bytes]:
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    out = {"model.embed_tokens.weight": rules.vocab(full["model.embed_tokens.weight"], rank, tp),
           "lm_head.weight": rules.vocab(full["lm_head.weight"], rank, tp),
           a + "o_proj.weight": rules.row(full[a + "o_proj.weight"], rank, tp),
           m + "gate_up_proj.weight": rules.merged([full[m + "gate_proj.weight"], full[m + "up_proj.weight"]], rank, tp),
           m + "down_proj.weight": rules.row(full[m + "down_proj.weight"], rank, tp),
           "model.layers.0.router.weight": rules.replicated(full["model.layers.0.router.weight"]),
           "model.layers.0.router.bias": rules.replicated(full["model.layers.0.router.bias"])}
    for part in ("weight", "bias") if qkv_bias else ("weight",):
        out[a + "qkv_proj." + part] = rules.qkv(full[a + "q_proj." + part], full[a + "k_proj." + part],
                                                full[a + "v_proj." + part], rank, tp, heads, kv_heads, head_size,
                                                head_size)
    return {n: raw(t) for n, t in out.items()}


def plan_loaded(path: str, rank: int, tp: int, dtype: torch.dtype,
                **shape) -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """Every parameter's bytes after gdskit's plan, made from vLLM's own layers' attributes, read
    ``path`` into them; and the tensors the plan left over, with why."""
    from gdskit.formats.placement_exec import plan_model, read_placements
    from gdskit.formats.shard_index import index_checkpoint

    model = build(rank, tp, dtype, **shape)
    index = index_checkpoint(path)
    plan, tensors = plan_model(model, index, lambda: (rank, tp))  # what vLLM's parallel group answers there
    read_placements(plan, tensors, {p: h.file_size for p, h in index.headers})
    return {n: raw(p) for n, p in model.named_parameters()}, [(u.source, u.why) for u in plan.uncovered]


def shapes(tp: int, heads: int, kv_heads: int, qkv_bias: bool = True) -> dict[str, int]:
    vocab = 100 if 128 % tp == 0 else 380  # padded to 128 rows, or to 384 for 3 ranks
    return dict(hidden=16, heads=heads, kv_heads=kv_heads, head_size=4, intermediate=6 * tp, vocab=vocab,
                qkv_bias=qkv_bias)


def compare(rules, tmp_path, tp: int, rank: int, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    """The stand-in, vLLM's loaders and the plan all give every parameter the same bytes."""
    from safetensors.torch import save_file

    shape = shapes(tp, heads, kv_heads)
    full = checkpoint(dtype=dtype, **shape)
    theirs = vllm_loaded(full, rank, tp, dtype, **shape)
    ours = stand_in_loaded(rules, full, rank, tp, **shape)
    assert set(theirs) == set(ours)
    for name in theirs:
        assert ours[name] == theirs[name], f"stand-in {name} at rank {rank} of {tp}"
    path = tmp_path / f"r{rank}of{tp}.safetensors"
    save_file(full, path)
    planned, left = plan_loaded(str(path), rank, tp, dtype, **shape)
    assert left == []
    for name in theirs:
        assert planned[name] == theirs[name], f"plan {name} at rank {rank} of {tp}"
