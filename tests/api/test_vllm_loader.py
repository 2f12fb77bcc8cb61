"""vLLM's load format ``gdskit`` (gdskit.vllm), through vLLM's own engine and classes.

Where vLLM is installed (the GPU machine's test run carries it), each engine runs in a fresh
process as a user starts one (tests/api/vllm_worker.py): vLLM finds the load format through the
installed entry point, and the model it builds with ``load_format="gdskit"`` must hold the
same bytes, and generate the same tokens, as with vLLM's own ``load_format="safetensors"``.
Where it is not, the loader's checks of its settings run over a stand-in of the three names
gdskit.vllm imports from vLLM (tests/support/vllm_stand_in.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest

from gdskit.errors import FormatError, GdskitError, InvalidArgumentError, MissingDependencyError
from repo_paths import REPO
from vllm_stand_in import HAS_VLLM, gdskit_vllm, load_config as _load_config  # noqa: F401 - a fixture

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm)")


def _declared_entry_points(pyproject: Path, group: str) -> dict[str, str]:
    """The entry points of ``group`` that pyproject.toml declares (its one table for the group)."""
    header = f'[project.entry-points."{group}"]'
    lines = pyproject.read_text().splitlines()
    body = lines[lines.index(header) + 1:]
    out = {}
    for line in body:
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            break
        if line:
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip().strip('"')
    return out


def test_the_package_declares_the_vllm_plugin() -> None:
    declared = _declared_entry_points(REPO / "pyproject.toml",
                                      "vllm.general_plugins")
    assert declared == {"gdskit": "gdskit.vllm:register"}
    try:
        dist = importlib.metadata.distribution("gdskit")
    except importlib.metadata.PackageNotFoundError:
        return  # run from the source tree alone: the declaration above is what an install writes
    installed = {e.name: e.value for e in dist.entry_points if e.group == "vllm.general_plugins"}
    assert installed == declared


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_module_says_what_to_install() -> None:
    with pytest.raises(MissingDependencyError, match="pip install vllm") as info:
        import gdskit.vllm  # noqa: F401
    assert isinstance(info.value, ImportError) and isinstance(info.value, GdskitError)
    assert "gdskit.vllm" not in sys.modules


@needs_vllm
def test_register_makes_the_load_format_known() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    import gdskit.vllm as gv
    gv.register()
    gv.register()  # a second call (vLLM loads plugins in each process, maybe again) changes nothing
    assert type(get_model_loader(LoadConfig(load_format="gdskit"))) is gv.GdskitModelLoader


@pytest.mark.parametrize("extra", [{"nope": 1}, {"max_inflight_bytes": 0}, {"max_inflight_bytes": "1GB"},
                                   {"max_inflight_bytes": True}, {1: 2, "nope": 3}, {"placement": "yes"},
                                   {"placement": 1}, {"placement": None}, {"placement": 0}])
def test_bad_extra_config_refused(gdskit_vllm, extra) -> None:
    with pytest.raises(InvalidArgumentError):
        gdskit_vllm.GdskitModelLoader(_load_config(extra))


@pytest.mark.parametrize("extra", ["max_inflight_bytes=1048576", '{"max_inflight_bytes": 1048576}', "",
                                   [("max_inflight_bytes", 1 << 20)], ["max_inflight_bytes"], [], 5, 0, 1.5,
                                   True, False, b"{}", object()],
                         ids=lambda v: "object" if type(v) is object else repr(v))
def test_extra_config_that_is_not_a_mapping_is_refused(gdskit_vllm, extra) -> None:
    with pytest.raises(InvalidArgumentError):
        gdskit_vllm.GdskitModelLoader(_load_config(extra))


@pytest.mark.parametrize("extra,budget,placement", [
    (None, None, False), ({}, None, False), ({"max_inflight_bytes": None}, None, False),
    ({"max_inflight_bytes": 1 << 20}, 1 << 20, False), (MappingProxyType({"max_inflight_bytes": 4096}), 4096, False),
    ({"placement": False}, None, False), ({"placement": True, "max_inflight_bytes": 4096}, 4096, True)])
def test_extra_config_taken(gdskit_vllm, extra, budget, placement) -> None:
    loader = gdskit_vllm.GdskitModelLoader(_load_config(extra))
    assert (loader.max_inflight_bytes, loader.placement) == (budget, placement)


@needs_vllm
def test_a_model_that_is_not_a_local_directory_is_refused(tmp_path) -> None:
    from vllm.config.load import LoadConfig

    import gdskit.vllm as gv
    loader = gv.GdskitModelLoader(LoadConfig(load_format="gdskit"))
    with pytest.raises(FormatError, match="local checkpoint directory"):
        loader.download_model(SimpleNamespace(model="some-org/some-model", subfolder=None))
    loader.download_model(SimpleNamespace(model=str(tmp_path), subfolder=None))


# -- whole engines, on the GPU ------------------------------------------------------------------

def _llama(tmp_path_factory, name: str, tied: bool) -> Path:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128,
                                      tie_word_embeddings=tied, torch_dtype="bfloat16")
    torch.manual_seed(3 if tied else 4)
    out = tmp_path_factory.mktemp(name)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, max_shard_size="400KB")
    assert (out / "model.safetensors.index.json").exists()
    return out


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    return {"tied": _llama(tmp_path_factory, "tied", True), "untied": _llama(tmp_path_factory, "untied", False)}


def _engine(path: Path, load_format: str, out: Path, extra: dict | None = None) -> tuple[dict, str]:
    """One vLLM engine in a fresh process: (what it wrote, its log)."""
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_LOGGING_LEVEL="INFO")
    args = [sys.executable, str(WORKER), str(path), load_format, str(out)] + ([json.dumps(extra)] if extra else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        return {}, log
    return json.loads(out.read_text()), log


@needs_vllm
@pytest.mark.gpu
@pytest.mark.parametrize("which,extra", [("tied", None), ("untied", {"max_inflight_bytes": 1 << 20})])
def test_gpu_engine_with_gdskit_matches_vllms_own_loader(llamas, tmp_path, which, extra) -> None:
    ref, ref_log = _engine(llamas[which], "safetensors", tmp_path / "ref.json")
    assert ref, ref_log[-4000:]
    ours, log = _engine(llamas[which], "gdskit", tmp_path / "ours.json", extra)
    assert ours, log[-4000:]
    assert ours["weights"] == ref["weights"]  # every parameter, byte for byte, as vLLM's own loader made it
    assert ours["tokens"] == ref["tokens"]
    assert len(ours["tokens"]) == 3 and all(len(t) == 12 for t in ours["tokens"])
    assert "gdskit read" in log and "ledger:" in log  # the ledger's summary, logged by the engine process


@needs_vllm
@pytest.mark.gpu
def test_gpu_engine_refuses_a_checkpoint_missing_a_parameter(llamas, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    src = llamas["untied"]
    dst = tmp_path / "missing"
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    dropped = "model.norm.weight"
    shard = index["weight_map"].pop(dropped)
    for f in sorted(set(index["weight_map"].values()) | {shard}):
        tensors = load_file(src / f)
        tensors.pop(dropped, None)
        save_file(tensors, dst / f, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    (dst / "config.json").write_text((src / "config.json").read_text())
    ours, log = _engine(dst, "gdskit", tmp_path / "ours.json")
    assert not ours
    assert "UninitializedWeightsError" in log and dropped in log, log[-4000:]


@pytest.mark.parametrize("extra", [{"verify": 1}, {"verify": "sha256:" + "0" * 64}, {"verify": b"x"},
                                   {"verify": True, "placement": True}])
def test_bad_verify_settings_are_refused(gdskit_vllm, extra) -> None:
    with pytest.raises(InvalidArgumentError):
        gdskit_vllm.GdskitModelLoader(_load_config(extra))


def test_verified_weights_reach_the_model_and_a_flipped_byte_is_refused(gdskit_vllm, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    import gdskit.safetensors as gs
    from gdskit.errors import ChecksumMismatchError
    from gdskit.formats import safetensors_format as fmt

    weights = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    gs.save_file(weights, tmp_path / "model.safetensors", digests=True)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64, 32))
            self.b = torch.nn.Parameter(torch.zeros(32))

        def load_weights(self, named):
            done = set()
            for name, t in named:
                getattr(self, name).data.copy_(t)
                done.add(name)
            return done

    config = SimpleNamespace(model=str(tmp_path), subfolder=None, quantization=None)
    model = Model()
    gdskit_vllm.GdskitModelLoader(_load_config({"verify": True})).load_weights(model, config)
    assert torch.equal(model.w.data, weights["w"]) and torch.equal(model.b.data, weights["b"])
    header = fmt.read_header_file(tmp_path / "model.safetensors")
    entry = next(e for e in header.entries if e.name == "b")
    with open(tmp_path / "model.safetensors", "r+b") as fh:
        fh.seek(header.data_start + entry.start + 9)
        byte = fh.read(1)[0]
        fh.seek(header.data_start + entry.start + 9)
        fh.write(bytes([byte ^ 1]))
    with pytest.raises(ChecksumMismatchError) as info:
        gdskit_vllm.GdskitModelLoader(_load_config({"verify": True})).load_weights(Model(), config)
    assert info.value.tensor == "b"


# -- the placement plan, on a vLLM-shaped model of stand-in layers (tests/vllm_fake_layers.py) ---

def _fake_checkpoint(tmp_path, cfg, extra: dict | None = None, drop: str | None = None) -> Path:
    from vllm_llama_shapes import save_checkpoint

    return save_checkpoint(tmp_path, cfg, extra, drop)


def _load(gv, model, path: Path, extra=None):
    """Load ``model`` with gdskit's loader; its report."""
    loader = gv.GdskitModelLoader(_load_config(extra))
    loader.load_weights(model, SimpleNamespace(model=str(path), subfolder=None, quantization=None))
    return loader.last_report


def _bytes(model) -> dict[str, bytes]:
    from vllm_llama_shapes import raw
    return {n: raw(p.data) for n, p in model.named_parameters()}


def _cfg(**kw):
    from vllm_llama_shapes import Cfg
    base = dict(hidden=16, heads=8, kv_heads=2, head_size=4, v_head_size=4, intermediate=24, vocab=100, tied=False,
                dtype="BF16", layers=2)
    base.update(kw)
    return Cfg(**base)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("tied", [False, True])
def test_placement_fills_every_parameter_as_the_models_own_loader(gdskit_vllm, tmp_path, tp, tied) -> None:
    import vllm_fake_layers as fake
    from vllm_llama_shapes import checkpoint, expected, raw

    cfg = _cfg(tied=tied, qkv_bias=True)
    path = _fake_checkpoint(tmp_path, cfg)
    n_tensors = len(checkpoint(cfg))
    for rank in range(tp):
        placed = fake.LlamaForCausalLM(cfg, rank, tp)
        ptrs = {n: p.data_ptr() for n, p in placed.named_parameters()}
        rep = _load(gdskit_vllm, placed, path, {"placement": True})
        assert {n: p.data_ptr() for n, p in placed.named_parameters()} == ptrs  # in place
        assert (rep.planned, rep.placed, rep.fallback, rep.fallback_bytes) == (True, n_tensors, 0, 0)
        own = fake.LlamaForCausalLM(cfg, rank, tp)
        rep_off = _load(gdskit_vllm, own, path, {"placement": False})
        assert (rep_off.planned, rep_off.placed, rep_off.fallback) == (False, 0, n_tensors)
        assert _bytes(placed) == _bytes(own)
        want = expected(checkpoint(cfg), cfg, rank, tp)
        assert _bytes(placed) == {n: raw(t) for n, t in want.items()}


def test_placement_hands_what_it_does_not_cover_to_load_weights(gdskit_vllm, tmp_path) -> None:
    import vllm_fake_layers as fake

    torch = pytest.importorskip("torch")
    cfg = _cfg(tied=True)
    k_proj = torch.randn(8, 16)  # F32: its slot of qkv_proj is filled by load_weights, q's and v's by the plan
    extra = {"model.layers.0.rotary_emb.inv_freq": torch.ones(2),                     # no such parameter
             "model.norm.weight": torch.arange(16, dtype=torch.float32),              # F32 into a BF16 parameter
             "model.layers.1.self_attn.k_proj.weight": k_proj,
             "lm_head.weight": torch.ones(100, 16, dtype=torch.bfloat16)}             # tied: the embedding's
    path = _fake_checkpoint(tmp_path, cfg, extra)
    # and both layers' o_proj (16 x 32 BF16 in the checkpoint), whose layers are of another quantization method
    model = fake.LlamaForCausalLM(cfg, 0, 2, o_proj_method=fake.Fp8LinearMethod)
    rep = _load(gdskit_vllm, model, path, {"placement": True})
    from vllm_llama_shapes import checkpoint
    n_tensors = len(checkpoint(cfg)) + 2  # the norm and k_proj replaced, two more
    assert rep.fallback == 4 + 2 + 1  # and the embedding, tied to lm_head.weight, which the checkpoint holds
    assert rep.placed == n_tensors - rep.fallback
    assert rep.fallback_bytes == 2 * 4 + 16 * 4 + 8 * 16 * 4 + 2 * 100 * 16 * 2 + 2 * 16 * 32 * 2
    assert sum(n for _, n in rep.reasons) == rep.fallback
    own = fake.LlamaForCausalLM(cfg, 0, 2, o_proj_method=fake.Fp8LinearMethod)
    _load(gdskit_vllm, own, path, {"placement": False})
    assert _bytes(model) == _bytes(own)
    assert torch.equal(model.model.norm.weight, torch.arange(16, dtype=torch.bfloat16))  # cast by load_weights
    k_rows = model.model.layers[1].self_attn.qkv_proj.weight[16:20]  # rank 0 of 2: 4 q heads, then its KV head
    assert torch.equal(k_rows, k_proj[:4].to(torch.bfloat16))


def test_a_model_the_plan_does_not_know_goes_through_load_weights(gdskit_vllm, tmp_path) -> None:
    import vllm_fake_layers as fake
    from vllm_llama_shapes import checkpoint

    cfg = _cfg()
    path = _fake_checkpoint(tmp_path, cfg)
    model = fake.OtherForCausalLM(cfg, 1, 2)
    rep = _load(gdskit_vllm, model, path, {"placement": True})
    assert (rep.planned, rep.placed, rep.fallback) == (True, 0, len(checkpoint(cfg)))
    own = fake.LlamaForCausalLM(cfg, 1, 2)
    _load(gdskit_vllm, own, path, {"placement": False})
    assert _bytes(model) == _bytes(own)


@pytest.mark.parametrize("placement", [True, False])
def test_a_parameter_the_checkpoint_lacks_is_refused_either_way(gdskit_vllm, tmp_path, placement) -> None:
    import vllm_fake_layers as fake

    cfg = _cfg()
    path = _fake_checkpoint(tmp_path, cfg, drop="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(gdskit_vllm.UninitializedWeightsError):
        _load(gdskit_vllm, fake.LlamaForCausalLM(cfg, 0, 2), path, {"placement": placement})


def test_a_shard_that_shrank_after_its_header_was_read_is_refused(gdskit_vllm, tmp_path) -> None:
    import vllm_fake_layers as fake
    from gdskit.formats.placement_exec import plan_model, read_placements
    from gdskit.formats.safetensors_format import TruncatedFileError
    from gdskit.formats.shard_index import index_checkpoint

    cfg = _cfg()
    path = _fake_checkpoint(tmp_path, cfg)
    index = index_checkpoint(str(path))
    plan, tensors = plan_model(fake.LlamaForCausalLM(cfg, 0, 1), index)
    shard = index.headers[-1][0]
    os.truncate(shard, os.path.getsize(shard) - 2)
    with pytest.raises(TruncatedFileError):
        read_placements(plan, tensors, {p: h.file_size for p, h in index.headers})


@pytest.mark.parametrize("tp, asked", [(1, True), (2, False)])
def test_only_plans_without_row_parallel_shards_ask_the_resident_loader(tmp_path, monkeypatch, tp, asked) -> None:
    """A row-parallel shard (a run per row) is read here in one batch, never sent as a read per
    row; a loader that does not serve leaves every byte to the read here."""
    import vllm_fake_layers as fake
    from gdskit.formats import placement_exec, through_resident
    from gdskit.formats.shard_index import index_checkpoint

    cfg = _cfg()
    path = _fake_checkpoint(tmp_path, cfg)
    index = index_checkpoint(str(path))
    plan, tensors = placement_exec.plan_model(fake.LlamaForCausalLM(cfg, 0, tp), index)
    asks = []
    monkeypatch.setattr(through_resident, "worth_asking", lambda *_a: True)
    monkeypatch.setattr(through_resident, "fill", lambda _t, _d, files, _targets, _p=None: asks.append(files) or False)
    assert placement_exec.read_placements(plan, tensors, {p: h.file_size for p, h in index.headers}) == \
        sum(pl.nbytes for pl in plan.placements)
    assert [len(files) for files in asks] == ([2] if asked else [])


def _with_f32(src: Path, dst: Path, names: set[str]) -> Path:
    """A copy of checkpoint ``src`` whose tensors ``names`` are stored as float32."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = {n: (t.to(torch.float32) if n in names else t) for n, t in load_file(f).items()}
            save_file(tensors, dst / f.name, metadata={"format": "pt"})
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@needs_vllm
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tied", "untied", "mixed"])
def test_gpu_engine_with_placement_matches_vllms_own_loader(llamas, tmp_path, which) -> None:
    """Placement on and off against vLLM's ``safetensors``, at tp=1: every parameter's bytes, greedy
    tokens, and which way the tensors went (``mixed``: two float32 tensors in a bfloat16 model go
    through load_weights, which converts them as vLLM's own loader does)."""
    from safetensors import safe_open

    path = llamas["untied" if which == "mixed" else which]
    fallback = {"model.norm.weight", "model.layers.0.self_attn.k_proj.weight"} if which == "mixed" else set()
    if fallback:
        path = _with_f32(path, tmp_path / "mixed", fallback)
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            names.update(fh.keys())
    fallback |= names & {"lm_head.weight"} if which == "tied" else set()  # tied: vLLM's loader skips it
    ref, ref_log = _engine(path, "safetensors", tmp_path / "ref.json")
    assert ref, ref_log[-4000:]
    for placement in (True, False):
        ours, log = _engine(path, "gdskit", tmp_path / f"ours-{placement}.json", {"placement": placement})
        assert ours, log[-4000:]
        assert ours["weights"] == ref["weights"]
        assert ours["tokens"] == ref["tokens"]
        report = ours["report"]
        assert report["planned"] is placement
        if placement:
            assert (report["placed"], report["fallback"]) == (len(names) - len(fallback), len(fallback))
        else:
            assert (report["placed"], report["fallback"]) == (0, len(names))


def test_counting_the_fallbacks_tensors_keeps_none_alive(gdskit_vllm) -> None:
    """The loader counts what it hands load_weights without holding a tensor while the next is read
    (iter_tensors' budget counts every tensor still referenced)."""
    import weakref

    torch = pytest.importorskip("torch")
    refs: list[weakref.ref] = []

    def stream():
        for i in range(3):
            assert not refs or refs[-1]() is None  # the consumer dropped the last one: nobody else holds it
            t = torch.zeros(4 + i)
            refs.append(weakref.ref(t))
            yield f"t{i}", t
            del t

    counted = gdskit_vllm._Counted()
    for _name, tensor in counted.through(stream()):
        del tensor
    assert (counted.tensors, counted.nbytes) == (3, (4 + 5 + 6) * 4)


@pytest.mark.parametrize("group,placed", [(None, False), ((1, 2), True), ((1, 4), False), ("raises", False)])
def test_an_embedding_without_its_rank_takes_the_parallel_groups(gdskit_vllm, tmp_path, group, placed) -> None:
    """vLLM 0.26's embeddings keep no ``tp_rank``: the loader asks vLLM's parallel group, whose size
    must be the layer's; without an answer the embedding goes through load_weights."""
    import vllm_fake_layers as fake
    from gdskit.formats.placement_exec import plan_model, read_placements
    from gdskit.formats.shard_index import index_checkpoint
    from vllm_llama_shapes import checkpoint, expected, raw

    cfg = _cfg()
    path = _fake_checkpoint(tmp_path, cfg)
    model = fake.LlamaForCausalLM(cfg, 1, 2)
    for layer in (model.model.embed_tokens, model.lm_head):
        del layer.tp_rank

    def ask():
        if group == "raises":
            raise AssertionError("tensor model parallel group is not initialized")  # what vLLM raises
        return group

    index = index_checkpoint(str(path))
    plan, tensors = plan_model(model, index, None if group is None else ask)
    embeddings = {"model.embed_tokens.weight", "lm_head.weight"}
    assert (embeddings & plan.placed_params) == (embeddings if placed else set())
    if placed:
        read_placements(plan, tensors, {p: h.file_size for p, h in index.headers})
        want = expected(checkpoint(cfg), cfg, 1, 2)
        for name in embeddings:
            assert raw(tensors[name]) == raw(want[name])
