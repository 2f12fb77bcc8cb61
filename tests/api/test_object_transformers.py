"""gdskit.transformers.load_model of a save_pretrained directory uploaded to moto's S3 server:
the model equals transformers' own from_pretrained of the local directory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gdskit.transformers as gtr  # noqa: E402
from gdskit.errors import FormatError  # noqa: E402

from object_server import moto_endpoint, s3  # noqa: E402, F401 - fixtures

pytestmark = pytest.mark.torch


def _llama(root):
    config = transformers.LlamaConfig(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=48,
                                      tie_word_embeddings=True)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.max_new_tokens = 7  # something the object's generation config must carry
    model.save_pretrained(root, max_shard_size="20KB")
    return root


def _upload(s3, local, prefix, skip=()):
    for f in sorted(local.iterdir()):
        if f.name not in skip:
            s3.put(prefix + f.name, f.read_bytes())


def test_load_model_of_an_object_prefix_equals_from_pretrained(s3, tmp_path):
    local = _llama(tmp_path / "llama")
    assert (local / "model.safetensors.index.json").exists() and (local / "generation_config.json").exists()
    _upload(s3, local, "models/llama/")
    s3.put("models/llama/deeper/config.json", b"{not json")  # objects below the prefix's own are not read
    got = gtr.load_model(s3.url("models/llama/"), "cpu")
    want = transformers.LlamaForCausalLM.from_pretrained(local)
    assert type(got) is type(want)
    assert got.state_dict().keys() == want.state_dict().keys()
    for name, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name
    assert got.generation_config.max_new_tokens == 7
    same_without_slash = gtr.load_model(s3.url("models/llama"), "cpu")
    assert torch.equal(same_without_slash.lm_head.weight, want.lm_head.weight)


def test_a_prefix_without_config_or_weights_is_a_format_error(s3, tmp_path):
    local = _llama(tmp_path / "llama")
    _upload(s3, local, "no-config/", skip={"config.json"})
    with pytest.raises(FormatError):
        gtr.load_model(s3.url("no-config/"), "cpu")
    s3.put("no-weights/config.json", (local / "config.json").read_bytes())
    with pytest.raises(FormatError):
        gtr.load_model(s3.url("no-weights/"), "cpu")


def test_a_config_object_too_large_to_be_one_is_refused(s3, tmp_path, monkeypatch):
    local = _llama(tmp_path / "llama")
    _upload(s3, local, "big/")
    monkeypatch.setattr(gtr, "_MAX_CONFIG_BYTES", 64)
    with pytest.raises(FormatError):
        gtr.load_model(s3.url("big/"), "cpu")
