"""A stand-in for vLLM's weight loaders' shard rules, for CI where vLLM is absent.

Each function makes the parameter one tensor-parallel rank holds and fills it from full
checkpoint tensors the way vLLM's loaders do: allocate the rank's parameter, then
``narrow`` a slot of it and ``copy_`` a ``narrow`` of the checkpoint tensor into it
(``ColumnParallelLinear``, ``RowParallelLinear``, ``QKVParallelLinear`` with its KV-head
replication, ``MergedColumnParallelLinear``, ``VocabParallelEmbedding``/``ParallelLMHead``
with ``pad_vocab_size``). Written from the rules, independently of
``gdskit.formats.placement``, so that the two can be compared; where vLLM is installed,
tests/test_vllm_placement.py checks these functions against vLLM's own loaders.

Memory not written by any rule keeps what ``garbage`` put there, so a test sees a rule
that leaves part of a parameter unfilled.
"""

from __future__ import annotations

import torch

PAD = 64


def garbage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A parameter as vLLM allocates it: ``torch.empty``, here filled with a fixed bit pattern."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(0xA5)
    return t


def replicated(full: torch.Tensor) -> torch.Tensor:
    param = garbage(tuple(full.shape), full.dtype)
    param.copy_(full)
    return param


def column(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """``ColumnParallelLinear``: the rank's block of rows (weight or bias)."""
    size = full.shape[0] // tp
    param = garbage((size, *full.shape[1:]), full.dtype)
    param.copy_(full.narrow(0, rank * size, size))
    return param


def row(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """``RowParallelLinear``: the rank's block of columns of a weight; a bias is whole."""
    if full.dim() == 1:
        return replicated(full)
    size = full.shape[1] // tp
    param = garbage((full.shape[0], size), full.dtype)
    param.copy_(full.narrow(1, rank * size, size))
    return param


def kv_layout(heads: int, kv_heads: int, tp: int) -> tuple[int, int, int]:
    """(query heads, KV heads, ranks per KV head) on each rank."""
    if tp >= kv_heads:
        return heads // tp, 1, tp // kv_heads
    return heads // tp, kv_heads // tp, 1


def qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, tp: int, heads: int, kv_heads: int,
        head_size: int, v_head_size: int) -> torch.Tensor:
    """``QKVParallelLinear``: [this rank's q heads | its k head(s) | its v head(s)]."""
    nh, nkv, replicas = kv_layout(heads, kv_heads, tp)
    sizes = (nh * head_size, nkv * head_size, nkv * v_head_size)
    param = garbage((sum(sizes), *q.shape[1:]), q.dtype)
    offset = 0
    for name, loaded, size in zip("qkv", (q, k, v), sizes):
        owner = rank if name == "q" else rank // replicas
        param.narrow(0, offset, size).copy_(loaded.narrow(0, owner * size, size))
        offset += size
    return param


def merged(pieces: list[torch.Tensor], rank: int, tp: int) -> torch.Tensor:
    """``MergedColumnParallelLinear``: each piece's block of rows, one after the other."""
    sizes = [p.shape[0] // tp for p in pieces]
    param = garbage((sum(sizes), *pieces[0].shape[1:]), pieces[0].dtype)
    offset = 0
    for loaded, size in zip(pieces, sizes):
        param.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))
        offset += size
    return param


def padded_vocab(vocab: int, pad: int = PAD) -> int:
    return (vocab + pad - 1) // pad * pad


def vocab(full: torch.Tensor, rank: int, tp: int, pad: int = PAD) -> torch.Tensor:
    """``VocabParallelEmbedding``/``ParallelLMHead``: the padded vocabulary's block of rows of
    this rank; its rows past the checkpoint's vocabulary are zero."""
    per_rank = padded_vocab(full.shape[0], pad) // tp
    start = min(rank * per_rank, full.shape[0])
    end = min(rank * per_rank + per_rank, full.shape[0])
    param = garbage((per_rank, *full.shape[1:]), full.dtype)
    param[: end - start].copy_(full.narrow(0, start, end - start))
    param[end - start:].fill_(0)
    return param
