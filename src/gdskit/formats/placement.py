"""Where each checkpoint tensor's bytes end up in an inference engine's parameters.

Pure arithmetic: no torch, no vLLM, no I/O. An engine such as vLLM builds its model with
fused and sharded parameters (``qkv_proj`` holding this rank's rows of ``q_proj``,
``k_proj`` and ``v_proj``; ``gate_up_proj`` those of ``gate_proj`` and ``up_proj``; a
row-parallel ``o_proj`` holding a column slice; a vocabulary-parallel embedding holding a
padded row range) and then copies each checkpoint tensor into its slot with a per-layer
weight loader. :func:`plan_placements` works out, from facts the layers carry
(:class:`ParamFacts`) and the checkpoint's records (:class:`Record`), which bytes of which
file this rank needs and where in the parameter's memory they go, as contiguous
:class:`Run` s, so that a reader can put them there directly.

The rules are vLLM's weight loaders' (vllm/model_executor/layers/linear.py and
vocab_parallel_embedding.py), with the first dimension as the output dimension:

- replicated: the whole tensor, as it is;
- column-parallel: rows ``[rank * n, (rank + 1) * n)`` of the tensor, ``n`` the
  parameter's rows: one contiguous run;
- row-parallel: columns ``[rank * n, (rank + 1) * n)`` of every row: one run per row (one
  run in all at one rank); a row-parallel layer's bias is whole on every rank;
- QKV: this rank's heads of q into the slot at 0, of k and v into the slots after it;
  where there are fewer KV heads than ranks, ``tp_size // total_kv_heads`` ranks share each
  KV head (rank ``r`` reads KV head ``r // replicas``);
- merged column (gate/up): piece ``i``'s rows ``[rank * s, (rank + 1) * s)``, ``s`` its
  size over the ranks, into the slot at ``sum(sizes[:i]) / tp_size``;
- vocabulary-parallel (embedding, LM head): the vocabulary padded to a multiple of
  ``padding_size`` (64), split evenly over the ranks; a rank's rows past the checkpoint's
  vocabulary are zero-filled.

Anything else (a layer kind it does not know, a dtype that differs from the parameter's, a
shape that does not add up, a tensor already fused on disk, a name two ways could claim)
is listed in :attr:`PlacementPlan.uncovered`, with why, for the engine's own loader.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

#: Bytes per element of the dtypes a placement copies as they are (safetensors' names).
ITEMSIZE: dict[str, int] = {"BF16": 2, "F16": 2, "F32": 4}
#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``.
VOCAB_PADDING = 64
#: The shard names of a QKV layer's pieces, in their order in the fused parameter.
QKV_PIECES = ("q", "k", "v")


class LayerKind(str, enum.Enum):
    """How a layer splits its parameters over tensor-parallel ranks."""

    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    QKV = "qkv"
    MERGED_COLUMN = "merged_column"
    VOCAB = "vocab"


@dataclasses.dataclass(frozen=True)
class QKVHeads:
    """A QKV layer's head counts over all ranks, and its head sizes."""

    total_num_heads: int
    total_num_kv_heads: int
    head_size: int
    v_head_size: int


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """A vocabulary-parallel layer's vocabulary: ``org_vocab_size`` rows in the checkpoint,
    padded to a multiple of ``padding_size``. ``num_embeddings`` beyond ``org_vocab_size``
    (LoRA's added rows) is not planned."""

    org_vocab_size: int
    num_embeddings: int
    padding_size: int = VOCAB_PADDING


@dataclasses.dataclass(frozen=True)
class ParamFacts:
    """One model parameter as this rank holds it.

    ``shape``: the parameter's shape here; ``dtype``: its safetensors dtype name (``"BF16"``);
    ``output_dim``/``input_dim``: the dimensions vLLM shards (None where a parameter has
    none, as a row-parallel bias); ``output_sizes``: a merged column layer's full size of
    each piece; ``heads``: a QKV layer's; ``vocab``: a vocabulary-parallel layer's.
    """

    name: str
    kind: LayerKind
    shape: tuple[int, ...]
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    output_dim: int | None = None
    input_dim: int | None = None
    output_sizes: tuple[int, ...] = ()
    heads: QKVHeads | None = None
    vocab: VocabSplit | None = None


@dataclasses.dataclass(frozen=True)
class Record:
    """One checkpoint tensor: its bytes are ``nbytes`` at ``file_offset`` of ``path``, row-major."""

    name: str
    path: str
    file_offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class Run(NamedTuple):
    """``nbytes`` contiguous bytes at ``file_offset`` of the file, to ``dest_offset`` bytes
    into the parameter's memory. A named tuple (immutable): a row-parallel shard is one
    run per row, 262,144 of them for a Llama-8B-shaped model at two ranks."""

    file_offset: int
    nbytes: int
    dest_offset: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """A checkpoint tensor's part that this rank keeps: ``runs`` read from ``path`` into
    parameter ``param``, whose slot for it starts at byte ``dest_offset``; ``zero_fill``:
    ``(dest_offset, nbytes)`` ranges of the parameter set to zero (vocabulary padding)."""

    source: str
    path: str
    param: str
    dest_offset: int
    runs: tuple[Run, ...]
    zero_fill: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        """The bytes this rank reads for it."""
        return sum(r.nbytes for r in self.runs)


@dataclasses.dataclass(frozen=True)
class Uncovered:
    """A checkpoint tensor (``nbytes`` in its file) the plan leaves to the engine's own
    loader, and why."""

    source: str
    why: str
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """Every checkpoint tensor, placed or left over, in the checkpoint's order."""

    placements: tuple[Placement, ...]
    uncovered: tuple[Uncovered, ...]

    @property
    def placed_params(self) -> frozenset[str]:
        """The parameters the placements write."""
        return frozenset(p.param for p in self.placements)


class _Refused(Exception):
    """A tensor the plan leaves to the fallback (internal: becomes an :class:`Uncovered`)."""


def plan_placements(params: Mapping[str, ParamFacts], records: Iterable[Record],
                    packed_modules: Mapping[str, Sequence[str]] | None = None,
                    unplanned: Mapping[str, str] | None = None) -> PlacementPlan:
    """Place each of ``records`` (in order) into ``params`` (by name).

    ``unplanned``: the model's other parameters, with why they are not described (their
    tensors are uncovered with that reason).

    A record's name is a parameter's name, or becomes one by putting a fused module's name
    in place of one of its pieces (``packed_modules``, the model's
    ``packed_modules_mapping``: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``; piece ``i``
    is shard ``i``, q/k/v for a QKV layer). Never raises for odd facts or records: those
    are :attr:`PlacementPlan.uncovered`.
    """
    pieces = _piece_index(packed_modules or {})
    placements: list[Placement] = []
    uncovered: list[Uncovered] = []
    for rec in records:
        try:
            param, shard = _resolve(rec.name, params, pieces, unplanned or {})
            placements.append(_place(params[param], rec, shard))
        except _Refused as why:
            uncovered.append(Uncovered(rec.name, str(why), rec.nbytes))
    return PlacementPlan(tuple(placements), tuple(uncovered))


def _piece_index(packed: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, int]]:
    """piece module name -> (fused module name, shard index); a piece claimed twice is dropped."""
    out: dict[str, tuple[str, int]] = {}
    twice: set[str] = set()
    for fused, names in packed.items():
        for i, piece in enumerate(names):
            if piece in out:
                twice.add(piece)
            out[piece] = (fused, i)
    for piece in twice:
        del out[piece]
    return out


def _resolve(name: str, params: Mapping[str, ParamFacts], pieces: Mapping[str, tuple[str, int]],
             unplanned: Mapping[str, str]) -> tuple[str, int | None]:
    """The parameter ``name`` fills and its shard index (None: the whole of a parameter)."""
    target, shard = _target(name, params, pieces, unplanned)
    if target in unplanned:
        raise _Refused(f"parameter {target!r}: {unplanned[target]}")
    if target not in params:
        raise _Refused(f"no parameter {target!r}")
    return target, shard


def _target(name: str, params: Mapping[str, ParamFacts], pieces: Mapping[str, tuple[str, int]],
            unplanned: Mapping[str, str]) -> tuple[str, int | None]:
    parts = name.split(".")
    fused = [(i, pieces[p]) for i, p in enumerate(parts[:-1]) if p in pieces]
    if len(fused) > 1:
        raise _Refused("more than one packed piece in the name")
    if fused:
        if name in params or name in unplanned:
            raise _Refused("both a parameter and a packed piece")
        i, (module, shard) = fused[0]
        return ".".join(parts[:i] + [module] + parts[i + 1:]), shard
    return name, None


def _place(p: ParamFacts, rec: Record, shard: int | None) -> Placement:
    try:
        p = dataclasses.replace(p, kind=LayerKind(p.kind), shape=tuple(p.shape))
    except ValueError:
        raise _Refused(f"layer kind {p.kind!r} is not planned") from None
    itemsize = ITEMSIZE.get(p.dtype)
    if itemsize is None:
        raise _Refused(f"parameter dtype {p.dtype} is not planned")
    if rec.dtype != p.dtype:
        raise _Refused(f"checkpoint dtype {rec.dtype}, parameter {p.dtype}")
    if not rec.shape or not p.shape or len(rec.shape) != len(p.shape) or len(p.shape) > 2:
        raise _Refused(f"shapes {list(rec.shape)} and {list(p.shape)} are not planned")
    if any(type(d) is not int or d < 0 for d in (*rec.shape, *p.shape)):
        raise _Refused("a dimension is not a non-negative integer")
    if rec.nbytes != math.prod(rec.shape) * itemsize or rec.file_offset < 0:
        raise _Refused("the record's size does not match its shape")
    if type(p.tp_size) is not int or type(p.tp_rank) is not int or not 0 <= p.tp_rank < p.tp_size:
        raise _Refused(f"rank {p.tp_rank!r} of {p.tp_size!r}")
    if p.kind is LayerKind.QKV or p.kind is LayerKind.MERGED_COLUMN:
        if shard is None:
            raise _Refused("a fused parameter's tensor already fused on disk")
    elif shard is not None:
        raise _Refused(f"a packed piece of a {p.kind.value} parameter")
    row = math.prod(rec.shape[1:]) * itemsize  # bytes per row of the first dimension
    if p.kind is LayerKind.REPLICATED:
        _same_shape(rec.shape, p.shape)
        return _rows(p, rec, 0, 0, rec.shape[0], row)
    if p.kind is LayerKind.ROW:
        return _place_row(p, rec, itemsize)
    if p.output_dim != 0:
        raise _Refused(f"output dimension {p.output_dim!r} is not planned")
    if rec.shape[1:] != p.shape[1:]:
        raise _Refused(f"checkpoint {list(rec.shape)} and parameter {list(p.shape)} differ past the output dimension")
    if p.kind is LayerKind.COLUMN:
        n = p.shape[0]
        if rec.shape[0] != n * p.tp_size:
            raise _Refused(f"{rec.shape[0]} rows do not split into {p.tp_size} of {n}")
        return _rows(p, rec, 0, p.tp_rank * n, n, row)
    if p.kind is LayerKind.QKV:
        assert shard is not None
        return _place_qkv(p, rec, shard, row)
    if p.kind is LayerKind.MERGED_COLUMN:
        assert shard is not None
        return _place_merged(p, rec, shard, row)
    if p.kind is LayerKind.VOCAB:
        return _place_vocab(p, rec, row)
    raise _Refused(f"layer kind {p.kind!r} is not planned")


def _same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    if a != b:
        raise _Refused(f"checkpoint {list(a)}, parameter {list(b)}")


def _rows(p: ParamFacts, rec: Record, dest_row: int, first: int, count: int, row: int) -> Placement:
    """Rows ``[first, first + count)`` of ``rec`` to rows from ``dest_row`` of ``p``: one run."""
    if min(dest_row, first, count) < 0 or dest_row + count > p.shape[0] or first + count > rec.shape[0]:
        raise _Refused("rows past the end")
    dest = dest_row * row
    runs = (Run(rec.file_offset + first * row, count * row, dest),) if count * row else ()
    return Placement(rec.name, rec.path, p.name, dest, runs)


def _place_row(p: ParamFacts, rec: Record, itemsize: int) -> Placement:
    if p.input_dim is None:  # a row-parallel layer's bias: whole on every rank
        _same_shape(rec.shape, p.shape)
        return _rows(p, rec, 0, 0, rec.shape[0], math.prod(rec.shape[1:]) * itemsize)
    if p.input_dim != 1 or len(p.shape) != 2:
        raise _Refused(f"input dimension {p.input_dim!r} is not planned")
    rows, cols = p.shape
    if rec.shape[0] != rows or rec.shape[1] != cols * p.tp_size:
        raise _Refused(f"checkpoint {list(rec.shape)} does not split into {p.tp_size} of {list(p.shape)}")
    if p.tp_size == 1:
        return _rows(p, rec, 0, 0, rows, cols * itemsize)
    width = cols * itemsize
    src_row = rec.shape[1] * itemsize
    first = rec.file_offset + p.tp_rank * width
    make = tuple.__new__  # a named tuple without its Python-level __new__: one per row
    runs = tuple(make(Run, (first + r * src_row, width, r * width)) for r in range(rows)) if width else ()
    return Placement(rec.name, rec.path, p.name, 0, runs)


def qkv_split(heads: QKVHeads, tp_size: int) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, num_kv_head_replicas)`` on each of ``tp_size`` ranks, as
    vLLM's QKV layer splits them; raises ValueError where it cannot."""
    if min(heads.total_num_heads, heads.total_num_kv_heads, heads.head_size, heads.v_head_size, tp_size) < 1:
        raise ValueError("head counts, head sizes and the rank count must be positive")
    if heads.total_num_heads % tp_size:
        raise ValueError(f"{heads.total_num_heads} heads do not split over {tp_size} ranks")
    if tp_size >= heads.total_num_kv_heads:
        if tp_size % heads.total_num_kv_heads:
            raise ValueError(f"{heads.total_num_kv_heads} KV heads do not spread over {tp_size} ranks")
        return heads.total_num_heads // tp_size, 1, tp_size // heads.total_num_kv_heads
    if heads.total_num_kv_heads % tp_size:
        raise ValueError(f"{heads.total_num_kv_heads} KV heads do not split over {tp_size} ranks")
    return heads.total_num_heads // tp_size, heads.total_num_kv_heads // tp_size, 1


def _place_qkv(p: ParamFacts, rec: Record, shard: int, row: int) -> Placement:
    h = p.heads
    if h is None or shard >= len(QKV_PIECES):
        raise _Refused("no head counts" if h is None else f"QKV shard {shard}")
    try:
        num_heads, num_kv, replicas = qkv_split(h, p.tp_size)
    except ValueError as exc:
        raise _Refused(str(exc)) from None
    q, k, v = num_heads * h.head_size, num_kv * h.head_size, num_kv * h.v_head_size
    if p.shape[0] != q + k + v:
        raise _Refused(f"{p.shape[0]} rows, the heads make {q + k + v}")
    totals = (h.total_num_heads * h.head_size, h.total_num_kv_heads * h.head_size,
              h.total_num_kv_heads * h.v_head_size)
    if rec.shape[0] != totals[shard]:
        raise _Refused(f"{rec.shape[0]} rows, {QKV_PIECES[shard]} has {totals[shard]}")
    slot, size = ((0, q), (q, k), (q + k, v))[shard]
    owner = p.tp_rank if shard == 0 else p.tp_rank // replicas
    return _rows(p, rec, slot, owner * size, size, row)


def _place_merged(p: ParamFacts, rec: Record, shard: int, row: int) -> Placement:
    sizes = p.output_sizes
    if shard >= len(sizes):
        raise _Refused(f"shard {shard} of {len(sizes)} pieces")
    if any(type(s) is not int or s < 0 or s % p.tp_size for s in sizes):
        raise _Refused(f"pieces {list(sizes)} do not split over {p.tp_size} ranks")
    if p.shape[0] != sum(sizes) // p.tp_size:
        raise _Refused(f"{p.shape[0]} rows, the pieces make {sum(sizes) // p.tp_size}")
    if rec.shape[0] != sizes[shard]:
        raise _Refused(f"{rec.shape[0]} rows, piece {shard} has {sizes[shard]}")
    size = sizes[shard] // p.tp_size
    return _rows(p, rec, sum(sizes[:shard]) // p.tp_size, p.tp_rank * size, size, row)


def vocab_rows(vocab: VocabSplit, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(first, end, per_rank)``: rank ``tp_rank`` holds ``per_rank`` rows, the first
    ``end - first`` of them the checkpoint's rows ``[first, end)``, the rest zero; raises
    ValueError where vLLM's layer could not be built so."""
    if vocab.num_embeddings != vocab.org_vocab_size:
        raise ValueError("added (LoRA) vocabulary rows are not planned")
    if vocab.padding_size < 1 or vocab.org_vocab_size < 0:
        raise ValueError("bad vocabulary facts")
    padded = -(-vocab.org_vocab_size // vocab.padding_size) * vocab.padding_size
    if padded % tp_size:
        raise ValueError(f"{padded} padded vocabulary rows do not split over {tp_size} ranks")
    per_rank = padded // tp_size
    first = min(tp_rank * per_rank, vocab.org_vocab_size)
    end = min(tp_rank * per_rank + per_rank, vocab.org_vocab_size)
    return first, end, per_rank


def _place_vocab(p: ParamFacts, rec: Record, row: int) -> Placement:
    if p.vocab is None:
        raise _Refused("no vocabulary facts")
    try:
        first, end, per_rank = vocab_rows(p.vocab, p.tp_rank, p.tp_size)
    except ValueError as exc:
        raise _Refused(str(exc)) from None
    if rec.shape[0] != p.vocab.org_vocab_size or p.shape[0] != per_rank:
        raise _Refused(f"checkpoint {rec.shape[0]} rows, parameter {p.shape[0]}; the vocabulary makes "
                       f"{p.vocab.org_vocab_size} and {per_rank}")
    placed = _rows(p, rec, 0, first, end - first, row)
    pad = (per_rank - (end - first)) * row
    zero = (((end - first) * row, pad),) if pad else ()
    return dataclasses.replace(placed, zero_fill=zero)
