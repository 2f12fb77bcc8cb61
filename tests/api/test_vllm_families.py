"""The load format's placement plan over the model families it places: Llama, Mistral, Qwen2
(q/k/v biases), Qwen3 (per-head q/k norms), with tied and untied embeddings, at every rank of
1, 2 and 4 tensor-parallel ranks.

In CI, the models are made of stand-in layers (tests/support/vllm_fake_layers.py) and checked
against the stand-in of vLLM's shard rules (tests/support/vllm_shard_rules.py). Where vLLM is
installed, the same checks run on vLLM's own model classes, built on the CPU
(tests/support/vllm_models.py): with ``placement`` on and off, gdskit's load must leave every
parameter with the bytes vLLM's own ``load_weights`` gives it, and the bytes the stand-in rules
make.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")

from vllm_families import FAMILIES, fake_model, family_cfg, mistral_format, write_checkpoint  # noqa: E402
from vllm_llama_shapes import checkpoint, expected, raw  # noqa: E402
from vllm_stand_in import gdskit_vllm, load_config  # noqa: E402, F401 - a fixture

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm)")


# -- stand-in layers, everywhere (CI) -------------------------------------------------------------

def _fake_load(gv, model, path: Path, extra: dict):
    from types import SimpleNamespace

    loader = gv.GdskitModelLoader(load_config(extra))
    loader.load_weights(model, SimpleNamespace(model=str(path), subfolder=None, quantization=None))
    return {n: raw(p.data) for n, p in model.named_parameters()}, loader.last_report


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_placed_as_the_shard_rules_place_it(gdskit_vllm, tmp_path, family, tied, tp) -> None:
    cfg = family_cfg(family, tied)
    full = checkpoint(cfg)
    path = write_checkpoint(tmp_path, full)
    for rank in range(tp):
        placed, report = _fake_load(gdskit_vllm, fake_model(family, cfg, rank, tp), path, {"placement": True})
        assert (report.placed, report.fallback) == (len(full), 0), report.reasons
        own, off = _fake_load(gdskit_vllm, fake_model(family, cfg, rank, tp), path, {"placement": False})
        assert (off.placed, off.fallback) == (0, len(full))
        want = {n: raw(t) for n, t in expected(full, cfg, rank, tp).items()}
        assert placed == own == want, f"{family} at rank {rank} of {tp}"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_tied_checkpoint_holding_its_head_too_sends_the_head_through_load_weights(gdskit_vllm, tmp_path,
                                                                                    tp) -> None:
    """A tied model (its config says so, and vLLM did not untie it) skips ``lm_head.weight``:
    the plan, which has no parameter of that name, leaves it to the model, which skips it, and
    leaves it the embedding too (vLLM 0.33 refuses to skip a tied name whose parameter it was
    not given)."""
    cfg = family_cfg("qwen2", True)
    full = checkpoint(cfg)
    full["lm_head.weight"] = full["model.embed_tokens.weight"].flip(0).contiguous()
    path = write_checkpoint(tmp_path, full)
    for rank in range(tp):
        placed, report = _fake_load(gdskit_vllm, fake_model("qwen2", cfg, rank, tp), path, {"placement": True})
        assert (report.placed, report.fallback) == (len(full) - 2, 2)
        assert len(report.reasons) == 2  # no parameter of that name; the embedding's tied name is in the checkpoint
        own, _ = _fake_load(gdskit_vllm, fake_model("qwen2", cfg, rank, tp), path, {"placement": False})
        assert placed == own == {n: raw(t) for n, t in expected(full, cfg, rank, tp).items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_mistral_format_goes_through_load_weights(gdskit_vllm, tmp_path, tp) -> None:
    """Mistral's own names are no parameter's: every tensor goes to the model, which renames and
    permutes them; the result is the model of the transformers-named checkpoint it came from."""
    cfg = family_cfg("mistral", False)
    hf = checkpoint(cfg)
    own_format = mistral_format(hf, cfg)
    path = write_checkpoint(tmp_path, own_format)
    for rank in range(tp):
        placed, report = _fake_load(gdskit_vllm, fake_model("mistral", cfg, rank, tp), path, {"placement": True})
        assert (report.placed, report.fallback) == (0, len(own_format))
        assert placed == {n: raw(t) for n, t in expected(hf, cfg, rank, tp).items()}


# -- vLLM's own model classes, on the CPU, where vLLM is installed ------------------------------

def _write_model(tmp_path: Path, family: str, cfg, tensors: dict, tied: bool = False) -> Path:
    """The checkpoint ``tensors`` and a config.json of ``family`` with ``cfg``'s widths: a model
    directory vLLM loads."""
    import vllm_models

    root = write_checkpoint(tmp_path / "model", tensors)
    vllm_models.write_config(root, family, tied=tied, heads=cfg.heads, kv_heads=cfg.kv_heads,
                             head_size=cfg.head_size, hidden=cfg.hidden, intermediate=cfg.intermediate,
                             vocab=cfg.vocab, layers=cfg.layers)
    return root


def _reference(tmp_path: Path, family: str, tied: bool, tp: int, *, head_in_checkpoint: bool = False) -> None:
    import vllm_models

    cfg = family_cfg(family, tied)
    full = checkpoint(cfg)
    if head_in_checkpoint:  # a tied model's checkpoint that holds its LM head too: vLLM unties it
        full["lm_head.weight"] = full["model.embed_tokens.weight"].flip(0).contiguous()
    root = _write_model(tmp_path, family, cfg, full, tied)
    untied = dataclasses.replace(cfg, tied=tied and not head_in_checkpoint)
    for rank in range(tp):
        _, theirs = vllm_models.vllm_loaded(root, full.items(), rank, tp, torch.bfloat16)
        want = {n: raw(t) for n, t in expected(full, untied, rank, tp).items()}
        assert theirs == want, f"the stand-in rules and vLLM's {family} differ at rank {rank} of {tp}"
        for placement in (True, False):
            _, ours, report = vllm_models.gdskit_loaded(root, str(root), rank, tp, torch.bfloat16,
                                                        {"placement": placement})
            assert ours == theirs, f"{family} placement={placement} at rank {rank} of {tp}"
            assert report.planned is placement
            if placement:
                assert (report.placed, report.fallback) == (len(full), 0), report.reasons
            else:
                assert (report.placed, report.fallback) == (0, len(full))


@needs_vllm
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_models_place_as_their_own_loaders(tmp_path, family, tied, tp) -> None:
    _reference(tmp_path, family, tied, tp)


@needs_vllm
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_vllm_tied_model_whose_checkpoint_holds_its_head(tmp_path, family, tp) -> None:
    """vLLM unties a tied model whose checkpoint holds an LM head of its own (it reads the
    model directory's headers): the head is then a parameter, placed as any other."""
    _reference(tmp_path, family, True, tp, head_in_checkpoint=True)


@needs_vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_mistral_format_goes_through_load_weights(tmp_path, tp) -> None:
    """A checkpoint in Mistral's own format names no parameter (vLLM's ``load_weights`` renames
    and permutes q and k): every tensor goes through it, and the model is vLLM's."""
    import vllm_models

    cfg = family_cfg("mistral", False)
    hf = checkpoint(cfg)
    full = mistral_format(hf, cfg)
    root = _write_model(tmp_path, "mistral", cfg, full)
    for rank in range(tp):
        _, theirs = vllm_models.vllm_loaded(root, full.items(), rank, tp, torch.bfloat16)
        assert theirs == {n: raw(t) for n, t in expected(hf, cfg, rank, tp).items()}  # the stand-in's permutation
        _, ours, report = vllm_models.gdskit_loaded(root, str(root), rank, tp, torch.bfloat16, {"placement": True})
        assert ours == theirs
        assert (report.placed, report.fallback) == (0, len(full))


@needs_vllm
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_tensors_of_another_dtype_go_through_load_weights(tmp_path, tp) -> None:
    """float32 tensors in a bfloat16 model (a norm, a q/k norm, one piece of a fused layer) are
    cast by vLLM's loaders: they fall back, counted, and the rest is placed."""
    import vllm_models

    cfg = family_cfg("qwen3", False)
    full = checkpoint(cfg)
    f32 = ("model.norm.weight", "model.layers.0.self_attn.k_norm.weight", "model.layers.1.self_attn.v_proj.weight")
    for name in f32:
        full[name] = full[name].float()
    root = _write_model(tmp_path, "qwen3", cfg, full)
    for rank in range(tp):
        _, theirs = vllm_models.vllm_loaded(root, full.items(), rank, tp, torch.bfloat16)
        _, ours, report = vllm_models.gdskit_loaded(root, str(root), rank, tp, torch.bfloat16, {"placement": True})
        assert ours == theirs
        assert (report.placed, report.fallback) == (len(full) - len(f32), len(f32))
        assert [n for _, n in report.reasons] == [len(f32)]  # one reason: the dtype
