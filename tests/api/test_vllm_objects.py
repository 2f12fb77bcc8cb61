"""vLLM's load format ``gdskit`` with its weights under an ``s3://`` prefix
(``model_loader_extra_config={"weights": "s3://bucket/prefix/"}``), the model's config in a local
directory, against moto's S3 server.

In CI, the model is made of stand-in layers (tests/support/vllm_fake_layers.py); where vLLM is
installed, it is vLLM's own model class built on the CPU (tests/support/vllm_models.py), and its
bytes must be those vLLM's own ``load_weights`` gives it from the local checkpoint.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")

from gdskit.errors import FormatError, GdskitFileNotFoundError, InvalidArgumentError  # noqa: E402
from object_server import moto_endpoint, s3  # noqa: E402, F401 - fixtures
from vllm_families import fake_model as _fake_model, family_cfg, write_checkpoint  # noqa: E402
from vllm_llama_shapes import checkpoint, expected, raw  # noqa: E402
from vllm_stand_in import gdskit_vllm, load_config  # noqa: E402, F401 - a fixture


HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm)")


def _upload(s3, local: Path, prefix: str) -> str:
    for f in sorted(local.iterdir()):
        if f.suffix in (".safetensors", ".json"):
            s3.put(prefix + f.name, f.read_bytes())
    return s3.url(prefix)


def _model_config(config_dir: Path, **kw) -> SimpleNamespace:
    return SimpleNamespace(model=str(config_dir), subfolder=None, quantization=None, **kw)


def _load(gv, model, config_dir: Path, extra: dict, **config):
    loader = gv.GdskitModelLoader(load_config(extra))
    loader.download_model(_model_config(config_dir, **config))
    loader.load_weights(model, _model_config(config_dir, **config))
    return {n: raw(p.data) for n, p in model.named_parameters()}, loader.last_report


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen3", False)])
def test_weights_from_an_object_prefix_fill_the_model_as_from_a_directory(gdskit_vllm, s3, tmp_path, family, tied,
                                                                          tp) -> None:
    import gdskit

    cfg = family_cfg(family, tied)
    full = checkpoint(cfg)
    local = write_checkpoint(tmp_path / "local", full)
    url = _upload(s3, local, f"models/{family}/")
    config_dir = tmp_path / "config"  # what vLLM reads itself: no weights in it
    config_dir.mkdir()
    for rank in range(tp):
        want = {n: raw(t) for n, t in expected(full, cfg, rank, tp).items()}
        for extra in ({"weights": url, "placement": True}, {"weights": url.rstrip("/")},
                      {"weights": str(local), "placement": True}):
            before = gdskit.stats()
            got, report = _load(gdskit_vllm, _fake_model(family, cfg, rank, tp), config_dir, extra)
            assert got == want, (extra, rank)
            assert report.placed + report.fallback == len(full)
            assert report.placed == (len(full) if extra.get("placement") else 0)
            objects = gdskit.stats_delta(before, gdskit.stats()).objects
            assert bool(objects) is extra["weights"].startswith("s3://")  # read from the store, not a copy


def test_a_prefix_without_weights_is_refused_before_loading(gdskit_vllm, s3, tmp_path) -> None:
    s3.put("empty/config.json", b"{}")
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    loader = gdskit_vllm.GdskitModelLoader(load_config({"weights": s3.url("empty/")}))
    with pytest.raises(FormatError):
        loader.download_model(_model_config(config_dir))
    model = _fake_model("llama", family_cfg("llama", False), 0, 1)
    with pytest.raises(FormatError):
        loader.load_weights(model, _model_config(config_dir))


def test_a_missing_shard_object_is_not_found(gdskit_vllm, s3, tmp_path) -> None:
    cfg = family_cfg("llama", False)
    local = write_checkpoint(tmp_path / "local", checkpoint(cfg))
    url = _upload(s3, local, "partial/")
    s3.client.delete_object(Bucket=s3.bucket, Key="partial/model-00002-of-00002.safetensors")
    loader = gdskit_vllm.GdskitModelLoader(load_config({"weights": url, "placement": True}))
    with pytest.raises(GdskitFileNotFoundError):
        loader.load_weights(_fake_model("llama", cfg, 0, 1), _model_config(tmp_path))


@pytest.mark.parametrize("weights", [5, b"s3://b/p/", "", "   ", "s3://b/p\x00/", ["s3://b/p/"], True])
def test_weights_that_are_not_a_place_are_refused(gdskit_vllm, weights) -> None:
    with pytest.raises(InvalidArgumentError):
        gdskit_vllm.GdskitModelLoader(load_config({"weights": weights}))


def test_a_malformed_bucket_or_a_missing_directory_is_refused(gdskit_vllm, s3, tmp_path) -> None:
    loader = gdskit_vllm.GdskitModelLoader(load_config({"weights": "s3://-not_a_bucket-/m/"}))
    with pytest.raises(InvalidArgumentError):
        loader.download_model(_model_config(tmp_path))
    loader = gdskit_vllm.GdskitModelLoader(load_config({"weights": str(tmp_path / "nowhere")}))
    with pytest.raises(FormatError):
        loader.download_model(_model_config(tmp_path))


def test_a_tied_head_in_weights_elsewhere_is_refused_where_vllm_unties(gdskit_vllm, s3, tmp_path) -> None:
    """vLLM 0.33 unties a tied model whose checkpoint, in the model's directory, holds its LM head;
    with the weights elsewhere it cannot: refused there, rather than a model other than vLLM's own
    loader makes. A vLLM that never unties (no such config attribute) drops the head either way."""
    cfg = family_cfg("qwen2", True)
    full = checkpoint(cfg)
    full["lm_head.weight"] = full["model.embed_tokens.weight"].flip(0).contiguous()
    url = _upload(s3, write_checkpoint(tmp_path / "local", full), "tied/")
    for placement in (True, False):
        with pytest.raises(gdskit_vllm.TiedHeadInCheckpointError):
            _load(gdskit_vllm, _fake_model("qwen2", cfg, 0, 2), tmp_path, {"weights": url, "placement": placement},
                  word_embeddings_untied_by_checkpoint=False)
        got, report = _load(gdskit_vllm, _fake_model("qwen2", cfg, 0, 2), tmp_path,
                            {"weights": url, "placement": placement})
        assert got == {n: raw(t) for n, t in expected(full, cfg, 0, 2).items()}
    untied = family_cfg("qwen2", False)  # the same checkpoint, the model untied by its config: loads
    got, _ = _load(gdskit_vllm, _fake_model("qwen2", untied, 1, 2), tmp_path, {"weights": url, "placement": True},
                   word_embeddings_untied_by_checkpoint=False)
    assert got == {n: raw(t) for n, t in expected(full, untied, 1, 2).items()}


# -- vLLM's own model classes, on the CPU, where vLLM is installed ------------------------------

@needs_vllm
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family,tied", [("llama", False), ("mistral", False), ("qwen2", True), ("qwen3", False)])
def test_vllm_model_from_an_object_prefix_is_vllms_own(s3, tmp_path, family, tied, tp) -> None:
    import vllm_models

    cfg = family_cfg(family, tied)
    full = checkpoint(cfg)
    shape = dict(tied=tied, heads=cfg.heads, kv_heads=cfg.kv_heads, head_size=cfg.head_size, hidden=cfg.hidden,
                 intermediate=cfg.intermediate, vocab=cfg.vocab, layers=cfg.layers)
    local = vllm_models.write_config(write_checkpoint(tmp_path / "local", full), family, **shape)
    url = _upload(s3, local, f"models/{family}/")
    config_dir = vllm_models.write_config(tmp_path / "config", family, **shape)  # config only
    for rank in range(tp):
        _, theirs = vllm_models.vllm_loaded(local, full.items(), rank, tp, torch.bfloat16)
        for placement in (True, False):
            _, ours, report = vllm_models.gdskit_loaded(config_dir, url, rank, tp, torch.bfloat16,
                                                        {"weights": url, "placement": placement})
            assert ours == theirs, (family, rank, placement)
            assert report.placed == (len(full) if placement else 0)


@needs_vllm
def test_vllm_tied_head_in_object_weights_is_refused(s3, tmp_path) -> None:
    import gdskit.vllm as gv
    import vllm_models

    cfg = family_cfg("qwen2", True)
    full = checkpoint(cfg)
    full["lm_head.weight"] = full["model.embed_tokens.weight"].flip(0).contiguous()
    shape = dict(tied=True, heads=cfg.heads, kv_heads=cfg.kv_heads, head_size=cfg.head_size, hidden=cfg.hidden,
                 intermediate=cfg.intermediate, vocab=cfg.vocab, layers=cfg.layers)
    url = _upload(s3, write_checkpoint(tmp_path / "local", full), "tied/")
    config_dir = vllm_models.write_config(tmp_path / "config", "qwen2", **shape)
    with pytest.raises(gv.TiedHeadInCheckpointError):
        vllm_models.gdskit_loaded(config_dir, url, 0, 2, torch.bfloat16, {"weights": url, "placement": True})
