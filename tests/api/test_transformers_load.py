"""gdskit.transformers.load_model against from_pretrained, on small models built from configs."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("gdskit.transformers needs transformers 5", allow_module_level=True)
from safetensors.torch import load_file, save_file  # noqa: E402

import gdskit.safetensors as gs  # noqa: E402
from gdskit.errors import FormatError, InvalidArgumentError  # noqa: E402
import gdskit.transformers as gtr  # noqa: E402

pytestmark = pytest.mark.torch


def bert_config():
    return transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=40, max_position_embeddings=48)


def llama_config():
    return transformers.LlamaConfig(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=48, max_position_embeddings=48,
                                    tie_word_embeddings=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A BERT-like masked LM in one file and a Llama-like causal LM with tied embeddings in shards."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.BertForMaskedLM(bert_config()).save_pretrained(root / "bert")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(root / "llama", max_shard_size="20KB")
    assert (root / "llama" / "model.safetensors.index.json").exists()
    assert "lm_head.weight" not in json.loads((root / "llama" / "model.safetensors.index.json").read_text())[
        "weight_map"]  # tied: saved once
    return {"bert": (root / "bert", transformers.BertForMaskedLM),
            "llama": (root / "llama", transformers.LlamaForCausalLM)}


def assert_same_model(ours, ref, vocab: int) -> None:
    assert type(ours) is type(ref)
    assert not ours.training
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert list(our_sd) == list(ref_sd)
    for k in ref_sd:
        assert our_sd[k].dtype == ref_sd[k].dtype and torch.equal(our_sd[k].cpu(), ref_sd[k].cpu()), k
    # Non-persistent buffers (rotary frequencies, position ids) are not in the checkpoint:
    # to_empty leaves them uninitialised unless they are set again.
    ref_buffers = dict(ref.named_buffers())
    for k, b in ours.named_buffers():
        assert b.dtype == ref_buffers[k].dtype and torch.equal(b.cpu(), ref_buffers[k].cpu()), k
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids.to(ref.device)).logits
        got = ours(ids.to(ours.device)).logits
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("which", ["bert", "llama"])
def test_outputs_identical_to_from_pretrained(checkpoints, which) -> None:
    path, cls = checkpoints[which]
    ref = cls.from_pretrained(path)
    ours = gtr.load_model(path, device="cpu")
    assert_same_model(ours, ref, 97)


def test_tied_embeddings_stay_one_tensor(checkpoints) -> None:
    path, _cls = checkpoints["llama"]
    model = gtr.load_model(path, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    saved = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            saved.update(load_file(os.path.join(path, name)))
    assert torch.equal(model.lm_head.weight, saved["model.embed_tokens.weight"])


def test_a_dtype_converted_as_from_pretrained_converts(checkpoints) -> None:
    path, cls = checkpoints["llama"]
    ref = cls.from_pretrained(path, dtype=torch.bfloat16)
    ours = gtr.load_model(path, device="cpu", torch_dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype is torch.bfloat16
    assert_same_model(ours, ref, 97)
    assert gtr.load_model(path, device="cpu", torch_dtype="bfloat16").dtype is torch.bfloat16
    with pytest.raises(InvalidArgumentError):
        gtr.load_model(path, device="cpu", torch_dtype="not-a-dtype")


def test_dtype_is_transformers_5s_name_for_torch_dtype(checkpoints) -> None:
    path, cls = checkpoints["llama"]
    ref = cls.from_pretrained(path, dtype=torch.bfloat16)
    ours = gtr.load_model(path, device="cpu", dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype is torch.bfloat16
    assert_same_model(ours, ref, 97)
    assert gtr.load_model(path, device="cpu", dtype="float16").dtype is torch.float16
    assert gtr.load_model(path, device="cpu", dtype="auto").dtype is cls.from_pretrained(path).dtype
    # Both given: the same dtype however it is named, or refused before anything is read.
    both = gtr.load_model(path, device="cpu", dtype="bfloat16", torch_dtype=torch.bfloat16)
    assert_same_model(both, ref, 97)
    with pytest.raises(InvalidArgumentError):
        gtr.load_model(path, device="cpu", dtype="not-a-dtype")
    for dtype, torch_dtype in [(torch.bfloat16, torch.float16), ("auto", torch.float32), (torch.float32, "auto")]:
        with pytest.raises(InvalidArgumentError):
            gtr.load_model(path, device="cpu", dtype=dtype, torch_dtype=torch_dtype)


def test_conflicting_dtypes_are_refused_before_the_checkpoint_is_read(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError):  # not a checkpoint either: the arguments are checked first
        gtr.load_model(tmp_path, device="cpu", dtype=torch.bfloat16, torch_dtype=torch.float16)


def test_base_model_from_a_checkpoint_with_a_head(checkpoints) -> None:
    path, _cls = checkpoints["bert"]
    with pytest.raises(gs.KeyMismatchError) as info:  # no pooler in a masked LM; its head is left over
        gtr.load_model(path, device="cpu", model_class=transformers.BertModel)
    assert sorted(info.value.missing_keys) == ["pooler.dense.bias", "pooler.dense.weight"]
    assert info.value.unexpected_keys and all(k.startswith("cls.") for k in info.value.unexpected_keys)
    ours = gtr.load_model(path, device="cpu", model_class=transformers.BertModel, strict=False)
    ref = transformers.BertModel.from_pretrained(path)
    ref_sd = ref.state_dict()
    for k, v in ours.state_dict().items():
        if not k.startswith("pooler."):  # initialised at random by both
            assert torch.equal(v, ref_sd[k]), k
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(ours(ids).last_hidden_state, ref(ids).last_hidden_state)


def test_an_auto_class_is_accepted(checkpoints) -> None:
    path, cls = checkpoints["llama"]
    ours = gtr.load_model(path, device="cpu", model_class=transformers.AutoModelForCausalLM)
    assert_same_model(ours, cls.from_pretrained(path), 97)


def test_missing_weight_refused_when_strict(tmp_path, checkpoints) -> None:
    src, cls = checkpoints["bert"]
    for name in os.listdir(src):
        if name != "model.safetensors":
            (tmp_path / name).write_bytes((src / name).read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["bert.encoder.layer.1.output.dense.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(gs.KeyMismatchError) as info:
        gtr.load_model(tmp_path, device="cpu")
    assert info.value.missing_keys == ["bert.encoder.layer.1.output.dense.bias"]
    model = gtr.load_model(tmp_path, device="cpu", strict=False)
    ref = cls.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        if k != "bert.encoder.layer.1.output.dense.bias":
            assert torch.equal(v, ref.state_dict()[k]), k


def test_modules_kept_in_float32_are_refused(checkpoints) -> None:
    path, cls = checkpoints["llama"]

    class KeepsHeadInFloat32(cls):
        _keep_in_fp32_modules_strict = ["lm_head"]

    with pytest.raises(gtr.UnsupportedModelError):
        gtr.load_model(path, device="cpu", model_class=KeepsHeadInFloat32, torch_dtype=torch.bfloat16)


def test_not_a_checkpoint_directory(tmp_path) -> None:
    with pytest.raises(FormatError):
        gtr.load_model(tmp_path, device="cpu")


class DropPathConfig(transformers.PretrainedConfig):
    model_type = "gdskit-test-drop-path"

    def __init__(self, depth: int = 3, width: int = 8, **kwargs) -> None:
        self.depth, self.width = depth, width
        super().__init__(**kwargs)


class DropPathModel(transformers.PreTrainedModel):
    """A model whose __init__ reads numbers out of a tensor, as remote-code models' drop-path
    schedules do: on the meta device that fails unless torch.linspace is kept on the CPU."""

    config_class = DropPathConfig

    def __init__(self, config: DropPathConfig) -> None:
        super().__init__(config)
        self.rates = [x.item() for x in torch.linspace(0, 0.1, config.depth)]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(config.width, config.width) for _ in range(config.depth))
        self.post_init()

    def _init_weights(self, module) -> None:
        if isinstance(module, torch.nn.Linear):
            transformers.initialization.normal_(module.weight, std=0.02)
            transformers.initialization.zeros_(module.bias)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_model_that_reads_tensors_in_its_constructor(tmp_path) -> None:
    torch.manual_seed(2)
    DropPathModel(DropPathConfig()).save_pretrained(tmp_path)
    ref = DropPathModel.from_pretrained(tmp_path)
    ours = gtr.load_model(tmp_path, device="cpu", model_class=DropPathModel)
    assert ours.rates == ref.rates
    assert list(ours.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k


def test_tied_weights_are_made_once(checkpoints) -> None:
    """Materialised on the device, a tied weight is one allocation from the start (to_empty
    makes one per module that holds it, and tie_weights drops the extra one afterwards)."""
    path, _cls = checkpoints["llama"]
    model = gtr._build_on_meta(transformers, torch, transformers.LlamaForCausalLM,
                               transformers.AutoConfig.from_pretrained(path), torch.float32)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    gtr._materialise(torch, model, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # no retie needed
    assert isinstance(model.lm_head.weight, torch.nn.Parameter) and model.lm_head.weight.device.type == "cpu"
    assert all(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["bert", "llama"])
def test_gpu_outputs_identical_to_from_pretrained_moved(checkpoints, which) -> None:
    path, cls = checkpoints[which]
    ref = cls.from_pretrained(path).to("cuda")
    ours = gtr.load_model(path, device="cuda:0")
    assert all(p.is_cuda for p in ours.parameters()) and all(b.is_cuda for b in ours.buffers())
    assert_same_model(ours, ref, 97)


@pytest.mark.gpu
def test_gpu_peak_memory_is_the_model(checkpoints) -> None:
    path, _cls = checkpoints["llama"]  # tied embeddings: allocated once
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = gtr.load_model(path, device="cuda:0")
    torch.cuda.synchronize()
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    assert torch.cuda.max_memory_allocated() - base <= 1.01 * size + (1 << 20)


def test_verified_load_model_equals_unverified_and_names_a_flipped_tensor(checkpoints, tmp_path) -> None:
    import shutil

    from gdskit.errors import ChecksumMismatchError, NothingToVerifyError
    from gdskit.formats import digest_scan
    from gdskit.formats import safetensors_format as fmt

    src, cls = checkpoints["llama"]
    path = tmp_path / "llama"
    shutil.copytree(src, path)
    with pytest.raises(NothingToVerifyError):
        gtr.load_model(path, "cpu", model_class=cls, verify=True)
    digest_scan.make_manifests([str(path)])
    ref = cls.from_pretrained(path)
    assert_same_model(gtr.load_model(path, "cpu", model_class=cls, verify=True), ref, 103)
    shard = sorted(path.glob("*.safetensors"))[1]
    header = fmt.read_header_file(shard)
    entry = header.entries[0]
    st = os.stat(shard)
    data = bytearray(shard.read_bytes())
    data[header.data_start + entry.start + 1] ^= 1
    shard.write_bytes(data)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ChecksumMismatchError) as info:
        gtr.load_model(path, "cpu", model_class=cls, verify=True)
    assert info.value.tensor == entry.name and info.value.path == str(shard)
    with pytest.raises(InvalidArgumentError):
        gtr.load_model(path, "cpu", model_class=cls, verify=3)
