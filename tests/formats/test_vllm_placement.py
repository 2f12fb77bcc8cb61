"""The placement plan (gdskit.formats.placement) against vLLM's shard rules.

A Llama-shaped checkpoint is written by the safetensors library; for every tensor-parallel
size and rank, the bytes the plan's runs pick out of the file (and the zeros it fills in)
must be the bytes of the parameter the stand-in of vLLM's weight loaders
(tests/vllm_shard_rules.py) makes from the same tensors. Where vLLM is installed, the
stand-in itself is checked against vLLM's own weight loaders (``test_stand_in_matches_vllm``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gdskit.formats.placement import (ITEMSIZE, LayerKind, ParamFacts, PlacementPlan, QKVHeads, Record,
                                      VocabSplit, plan_placements)
from gdskit.formats.shard_index import index_checkpoint

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
import vllm_shard_rules as rules  # noqa: E402  (tests/support is on sys.path)
from vllm_llama_shapes import DTYPES, Cfg, checkpoint, expected, facts, raw  # noqa: E402

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def records(path) -> list[Record]:
    index = index_checkpoint(str(path))
    return [Record(name, loc.path, loc.file_offset, loc.entry.nbytes, loc.entry.dtype, tuple(loc.entry.shape))
            for name, loc in index.tensors.items()]


def apply(plan: PlacementPlan, params: dict[str, ParamFacts]) -> dict[str, bytes]:
    """What the plan writes into each parameter, read from the files with plain Python; memory
    the plan does not write keeps the stand-in's fill pattern. Refuses a byte written twice."""
    out: dict[str, np.ndarray] = {}
    written: dict[str, np.ndarray] = {}
    files: dict[str, bytes] = {}
    for pl in plan.placements:
        facts_ = params[pl.param]
        nbytes = math.prod(facts_.shape) * ITEMSIZE[facts_.dtype]
        buf = out.setdefault(pl.param, np.full(nbytes, 0xA5, dtype=np.uint8))
        seen = written.setdefault(pl.param, np.zeros(nbytes, dtype=np.int64))
        data = files.get(pl.path)
        if data is None:
            with open(pl.path, "rb") as fh:
                data = files[pl.path] = fh.read()
        for run in pl.runs:
            assert 0 <= run.dest_offset and run.dest_offset + run.nbytes <= nbytes
            buf[run.dest_offset:run.dest_offset + run.nbytes] = np.frombuffer(
                data, dtype=np.uint8, count=run.nbytes, offset=run.file_offset)
            seen[run.dest_offset:run.dest_offset + run.nbytes] += 1
        for start, n in pl.zero_fill:
            buf[start:start + n] = 0
            seen[start:start + n] += 1
    for name, seen in written.items():
        assert seen.max(initial=0) <= 1, f"{name}: a byte written twice"
    return {name: buf.tobytes() for name, buf in out.items()}


def check_every_rank(tmp_path, cfg: Cfg, tp: int, shards: int = 1) -> None:
    full = checkpoint(cfg)
    names = list(full)
    if shards == 1:
        path = tmp_path / "model.safetensors"
        safetensors_torch.save_file(full, path)
        paths = [path]
    else:
        half = len(names) // 2
        paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
        safetensors_torch.save_file({n: full[n] for n in names[:half]}, paths[0])
        safetensors_torch.save_file({n: full[n] for n in names[half:]}, paths[1])
    recs = [r for p in paths for r in records(p)]
    for rank in range(tp):
        params = facts(cfg, rank, tp)
        plan = plan_placements(params, recs, PACKED)
        assert plan.uncovered == ()  # every tensor of a plain Llama is placed
        got = apply(plan, params)
        want = expected(full, cfg, rank, tp)
        assert set(got) == set(want) == set(params)
        for name in want:
            assert got[name] == raw(want[name]), f"{name} at rank {rank} of {tp}"
        per_source = {pl.source for pl in plan.placements}
        assert per_source == set(full)


def _shapes(tp: int) -> st.SearchStrategy[Cfg]:
    # a vocabulary whose padded rows split over the ranks (vLLM cannot build the layer otherwise), drawn
    # directly: filtering 1..400 for it at tp=3 discards most draws and trips hypothesis' health check
    blocks = tp // math.gcd(tp, rules.PAD)  # padded rows come in 64s; this many of them split over tp

    def build(heads_per_rank, kv_choice, head_size, v_same, inter_per_rank, hidden_mult, vocab_blocks, vocab_short,
              tied, dtype, bias):
        vocab = vocab_blocks * blocks * rules.PAD - vocab_short
        heads = heads_per_rank * tp
        kv_options = [k for k in range(1, heads + 1) if heads % k == 0 and (k % tp == 0 or tp % k == 0)]
        kv = kv_options[kv_choice % len(kv_options)]
        v_head = head_size if v_same else head_size * 2
        return Cfg(hidden=hidden_mult * 4, heads=heads, kv_heads=kv, head_size=head_size, v_head_size=v_head,
                   intermediate=inter_per_rank * tp, vocab=vocab, tied=tied, dtype=dtype, qkv_bias=bias)
    return st.builds(build, st.integers(1, 3), st.integers(0, 16), st.sampled_from([2, 4, 8]), st.booleans(),
                     st.integers(1, 6), st.integers(1, 6), st.integers(1, max(1, 6 // blocks)),
                     st.integers(0, rules.PAD - 1), st.booleans(),
                     st.sampled_from(sorted(DTYPES)), st.booleans())


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_plan_places_what_vllms_shard_rules_place(tmp_path_factory, tp, data) -> None:
    cfg = data.draw(_shapes(tp))
    assert rules.padded_vocab(cfg.vocab) % tp == 0
    check_every_rank(tmp_path_factory.mktemp("ckpt"), cfg, tp)


@pytest.mark.parametrize("tp,heads,kv", [(1, 4, 4), (2, 8, 2), (4, 8, 2), (8, 8, 2), (8, 16, 1), (3, 6, 3),
                                         (3, 6, 1), (4, 4, 4), (8, 32, 8)])
@pytest.mark.parametrize("tied", [True, False])
def test_gqa_and_kv_head_replication(tmp_path, tp, heads, kv, tied) -> None:
    vocab = 300 if tp != 3 else 380  # 320 and 384 padded rows: 3 ranks need 384
    cfg = Cfg(hidden=16, heads=heads, kv_heads=kv, head_size=4, v_head_size=4, intermediate=6 * tp, vocab=vocab,
              tied=tied, dtype="BF16", layers=2)
    check_every_rank(tmp_path, cfg, tp, shards=2)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_float_dtype_and_a_qkv_bias(tmp_path, dtype) -> None:
    cfg = Cfg(hidden=8, heads=4, kv_heads=2, head_size=2, v_head_size=2, intermediate=8, vocab=70, tied=False,
              dtype=dtype, qkv_bias=True)
    check_every_rank(tmp_path, cfg, 2)


def test_vocab_padding_rows_are_zero_on_the_last_rank(tmp_path) -> None:
    cfg = Cfg(hidden=4, heads=2, kv_heads=2, head_size=2, v_head_size=2, intermediate=4, vocab=65, tied=True,
              dtype="F32")  # 128 padded rows: rank 1 holds row 64 of the checkpoint and 63 zero rows
    full = checkpoint(cfg)
    safetensors_torch.save_file(full, tmp_path / "m.safetensors")
    params = facts(cfg, 1, 2)
    plan = plan_placements(params, records(tmp_path / "m.safetensors"), PACKED)
    emb = next(p for p in plan.placements if p.param == "model.embed_tokens.weight")
    assert emb.nbytes == 4 * 4 and emb.zero_fill == ((16, 63 * 16),)
    got = np.frombuffer(apply(plan, params)["model.embed_tokens.weight"], dtype=np.float32).reshape(64, 4)
    np.testing.assert_array_equal(got[0], full["model.embed_tokens.weight"][64].numpy())
    assert not got[1:].any()


def test_row_parallel_reads_one_run_per_row(tmp_path) -> None:
    w = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    safetensors_torch.save_file({"o.weight": w, "o.bias": torch.arange(6.0)}, tmp_path / "m.safetensors")
    recs = records(tmp_path / "m.safetensors")
    for rank in range(4):
        params = {"o.weight": ParamFacts("o.weight", LayerKind.ROW, (6, 2), "F32", rank, 4, output_dim=0, input_dim=1),
                  "o.bias": ParamFacts("o.bias", LayerKind.ROW, (6,), "F32", rank, 4, output_dim=0)}
        plan = plan_placements(params, recs)
        weight = next(p for p in plan.placements if p.param == "o.weight")
        assert len(weight.runs) == 6 and all(r.nbytes == 8 for r in weight.runs)
        got = apply(plan, params)
        assert got["o.weight"] == raw(rules.row(w, rank, 4))
        assert got["o.bias"] == raw(torch.arange(6.0))  # a row-parallel bias is whole on every rank


# -- what the plan leaves to the engine's own loader ------------------------------------------

def _one(tmp_path, tensors: dict[str, torch.Tensor]) -> list[Record]:
    safetensors_torch.save_file(tensors, tmp_path / "m.safetensors")
    return records(tmp_path / "m.safetensors")


def _col(name: str, shape, dtype: str = "BF16", **kw) -> ParamFacts:
    return ParamFacts(name, kw.pop("kind", LayerKind.COLUMN), tuple(shape), dtype, kw.pop("rank", 0),
                      kw.pop("tp", 1), output_dim=kw.pop("output_dim", 0), input_dim=1, **kw)


@pytest.mark.parametrize("case", ["dtype", "fused_on_disk", "unknown_name", "shape", "quantized", "split",
                                  "kind", "both_names", "output_dim", "no_heads", "lora_vocab", "vocab_split"])
def test_odd_tensors_are_left_to_the_fallback(tmp_path, case) -> None:
    bf = torch.ones(8, 4, dtype=torch.bfloat16)
    tensors = {"a.q_proj.weight": bf, "a.k_proj.weight": bf.clone(), "a.v_proj.weight": bf.clone()}
    heads = QKVHeads(4, 4, 2, 2)
    params = {"a.qkv_proj.weight": _col("a.qkv_proj.weight", (24, 4), kind=LayerKind.QKV, heads=heads)}
    want = "a.q_proj.weight"
    if case == "dtype":
        tensors[want] = bf.float()
    elif case == "fused_on_disk":
        tensors = {"a.qkv_proj.weight": torch.ones(24, 4, dtype=torch.bfloat16)}
        want = "a.qkv_proj.weight"
    elif case == "unknown_name":
        tensors["a.rotary_emb.inv_freq"] = torch.ones(2)
        want = "a.rotary_emb.inv_freq"
    elif case == "shape":
        tensors[want] = torch.ones(8, 5, dtype=torch.bfloat16)
    elif case == "quantized":
        tensors = {"c.weight": torch.ones(8, 4, dtype=torch.int8)}
        params = {"c.weight": _col("c.weight", (8, 4), dtype="I8")}
        want = "c.weight"
    elif case == "split":
        tensors = {"c.weight": bf[:7]}
        params = {"c.weight": _col("c.weight", (3, 4), tp=2)}  # 7 rows do not split into 2 of 3
        want = "c.weight"
    elif case == "kind":
        tensors = {"c.weight": bf}
        params = {"c.weight": _col("c.weight", (8, 4), kind="mamba")}
        want = "c.weight"
    elif case == "both_names":
        params["a.q_proj.weight"] = _col("a.q_proj.weight", (8, 4))
    elif case == "output_dim":
        tensors = {"c.weight": bf}
        params = {"c.weight": _col("c.weight", (8, 4), output_dim=1)}
        want = "c.weight"
    elif case == "no_heads":
        params = {"a.qkv_proj.weight": _col("a.qkv_proj.weight", (24, 4), kind=LayerKind.QKV)}
    elif case == "lora_vocab":
        tensors = {"e.weight": bf}
        params = {"e.weight": _col("e.weight", (64, 4), kind=LayerKind.VOCAB, vocab=VocabSplit(8, 12))}
        want = "e.weight"
    elif case == "vocab_split":
        tensors = {"e.weight": bf}
        params = {"e.weight": _col("e.weight", (22, 4), kind=LayerKind.VOCAB, tp=3, vocab=VocabSplit(8, 8))}
        want = "e.weight"  # 64 padded rows do not split over 3 ranks
    plan = plan_placements(params, _one(tmp_path, tensors), PACKED)
    assert want in {u.source for u in plan.uncovered}
    assert want not in {p.source for p in plan.placements}


# -- hostile facts and records never make the plan read or write out of bounds ----------------

_ints = st.integers(-3, 70)
_FIELDS = ("p_rows", "p_cols", "r_rows", "r_cols", "tp_rank", "tp_size", "heads", "kv_heads", "head_size",
           "v_head_size", "sizes", "vocab", "padding", "nbytes", "offset", "input_dim", "output_dim")


@st.composite
def _near_valid(draw):
    """A parameter and a record that fit (``perturbed`` None), or the same with one fact replaced
    by an arbitrary small integer (``perturbed`` names it)."""
    kind = draw(st.sampled_from(list(LayerKind)))
    tp = draw(st.integers(1, 8))
    rank = draw(st.integers(0, tp - 1))
    cols = draw(st.integers(1, 5))
    name, out_dim, in_dim, heads, sizes, vocab = "x.weight", 0, 1, None, (), None
    if kind is LayerKind.REPLICATED:
        p_shape = r_shape = (draw(st.integers(1, 6)), cols)
    elif kind is LayerKind.COLUMN:
        n = draw(st.integers(1, 6))
        p_shape, r_shape = (n, cols), (n * tp, cols)
    elif kind is LayerKind.ROW:
        rows = draw(st.integers(1, 6))
        p_shape, r_shape = (rows, cols), (rows, cols * tp)
    elif kind is LayerKind.QKV:
        nh = tp * draw(st.integers(1, 3))
        kv = draw(st.sampled_from([k for k in range(1, nh + 1) if nh % k == 0 and (k % tp == 0 or tp % k == 0)]))
        hs, vhs = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        heads = QKVHeads(nh, kv, hs, vhs)
        q, nkv = nh // tp, max(1, kv // tp)
        piece = draw(st.sampled_from(["q", "k", "v"]))
        name = f"x.{piece}_proj.weight"
        p_shape = ((q + nkv) * hs + nkv * vhs, cols)
        r_shape = ({"q": nh * hs, "k": kv * hs, "v": kv * vhs}[piece], cols)
    elif kind is LayerKind.MERGED_COLUMN:
        sizes = (tp * draw(st.integers(1, 4)), tp * draw(st.integers(1, 4)))
        piece = draw(st.integers(0, 1))
        name = f"x.{('gate', 'up')[piece]}_proj.weight"
        p_shape, r_shape = (sum(sizes) // tp, cols), (sizes[piece], cols)
    else:
        pad = draw(st.sampled_from([4, 8, 64]))
        v = draw(st.integers(1, 70))
        padded = -(-v // pad) * pad
        assume(padded % tp == 0)
        vocab = VocabSplit(v, v, pad)
        p_shape, r_shape = (padded // tp, cols), (v, cols)
    fused = {LayerKind.QKV: "x.qkv_proj.weight", LayerKind.MERGED_COLUMN: "x.gate_up_proj.weight"}
    facts = dict(name=fused.get(kind, "x.weight"), kind=kind, shape=p_shape, dtype="BF16", tp_rank=rank, tp_size=tp,
                 output_dim=out_dim, input_dim=in_dim, output_sizes=sizes, heads=heads, vocab=vocab)
    rec = dict(name=name, path="f", file_offset=draw(st.integers(0, 64)), nbytes=math.prod(r_shape) * 2,
               dtype="BF16", shape=r_shape)
    perturbed = draw(st.none() | st.sampled_from(_FIELDS))
    bad = draw(_ints)
    if perturbed in ("p_rows", "p_cols"):
        shape = list(p_shape)
        shape[perturbed == "p_cols"] = bad
        facts["shape"] = tuple(shape)
    elif perturbed in ("r_rows", "r_cols"):
        shape = list(r_shape)
        shape[perturbed == "r_cols"] = bad
        rec["shape"] = tuple(shape)
    elif perturbed in ("tp_rank", "tp_size", "input_dim", "output_dim"):
        facts[perturbed] = bad
    elif perturbed in ("heads", "kv_heads", "head_size", "v_head_size") and heads is not None:
        field = {"heads": "total_num_heads", "kv_heads": "total_num_kv_heads"}.get(perturbed, perturbed)
        facts["heads"] = dataclasses.replace(heads, **{field: bad})
    elif perturbed == "sizes" and sizes:
        facts["output_sizes"] = (sizes[0], bad)
    elif perturbed in ("vocab", "padding") and vocab is not None:
        facts["vocab"] = dataclasses.replace(vocab, **{"org_vocab_size" if perturbed == "vocab" else "padding_size": bad})
    elif perturbed == "nbytes":
        rec["nbytes"] = bad
    elif perturbed == "offset":
        rec["file_offset"] = bad
    else:
        perturbed = None
    return ParamFacts(**facts), Record(**rec), perturbed


@settings(max_examples=600, deadline=None)
@given(_near_valid())
def test_hostile_facts_never_escape_their_tensor_or_parameter(case) -> None:
    p, rec, perturbed = case
    plan = plan_placements({p.name: p}, [rec], PACKED)
    assert len(plan.placements) + len(plan.uncovered) == 1
    if perturbed is None:
        assert plan.placements, plan.uncovered  # what fits is placed
    for pl in plan.placements:
        pbytes = math.prod(p.shape) * ITEMSIZE[p.dtype]
        covered = np.zeros(pbytes, dtype=np.int64)
        for r in pl.runs:
            assert r.nbytes > 0
            assert rec.file_offset <= r.file_offset and r.file_offset + r.nbytes <= rec.file_offset + rec.nbytes
            assert 0 <= r.dest_offset and r.dest_offset + r.nbytes <= pbytes
            covered[r.dest_offset:r.dest_offset + r.nbytes] += 1
        for start, n in pl.zero_fill:
            assert 0 <= start and start + n <= pbytes
            covered[start:start + n] += 1
        assert covered.max(initial=0) <= 1


# -- the stand-in against vLLM's own loaders, where vLLM is installed --------------------------

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm)")
@pytest.mark.parametrize("tp,heads,kv", [(1, 4, 2), (2, 4, 2), (4, 4, 2), (8, 8, 2), (8, 16, 1), (2, 8, 8),
                                         (3, 6, 3), (3, 6, 1)])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_stand_in_and_plan_match_vllms_own_loaders(tmp_path, tp, heads, kv, dtype) -> None:
    import vllm_reference  # tests/: builds vLLM's own layers on the CPU
    for rank in range(tp):
        vllm_reference.compare(rules, tmp_path, tp=tp, rank=rank, heads=heads, kv_heads=kv, dtype=DTYPES[dtype])
