"""vLLM's load format ``gdskit`` (gdskit.vllm), through vLLM's own engine and classes.

Where vLLM is installed (the GPU machine's test run carries it), each engine runs in a fresh
process as a user starts one (tests/api/vllm_worker.py): vLLM finds the load format through the
installed entry point, and the model it builds with ``load_format="gdskit"`` must hold the
same bytes, and generate the same tokens, as with vLLM's own ``load_format="safetensors"``.
Where it is not, the loader's checks of its settings run over a stand-in of the three names
gdskit.vllm imports from vLLM (:func:`_vllm_stand_in`).
"""

from __future__ import annotations

import abc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest

from gdskit.errors import FormatError, GdskitError, InvalidArgumentError, MissingDependencyError
from repo_paths import REPO

HAS_VLLM = importlib.util.find_spec("vllm") is not None
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


def _vllm_stand_in() -> dict[str, types.ModuleType]:
    """The modules that hold what gdskit.vllm imports from vLLM, as strict as vLLM's own:
    ``BaseModelLoader`` is an abstract class that keeps its ``load_config`` and whose two loading
    methods a subclass must define; ``register_model_loader`` takes only its subclasses."""
    class BaseModelLoader(abc.ABC):
        def __init__(self, load_config) -> None:
            self.load_config = load_config

        @abc.abstractmethod
        def download_model(self, model_config) -> None: ...

        @abc.abstractmethod
        def load_weights(self, model, model_config) -> None: ...

    def register_model_loader(load_format: str):
        def register(cls):
            if not issubclass(cls, BaseModelLoader):
                raise TypeError(f"{cls} is not a BaseModelLoader")
            return cls
        return register

    names = ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader",
             "vllm.model_executor.model_loader.base_loader")
    modules = {name: types.ModuleType(name) for name in names}
    modules["vllm.model_executor.model_loader"].register_model_loader = register_model_loader
    modules["vllm.model_executor.model_loader.base_loader"].BaseModelLoader = BaseModelLoader
    return modules


@pytest.fixture
def gdskit_vllm(monkeypatch):
    """gdskit.vllm over vLLM where it is installed, else over :func:`_vllm_stand_in`
    (imported afresh, and forgotten afterwards: without vLLM the module is not importable)."""
    pytest.importorskip("torch")
    if HAS_VLLM:
        import gdskit.vllm as gv
        yield gv
        return
    for name, module in _vllm_stand_in().items():
        monkeypatch.setitem(sys.modules, name, module)
    import gdskit
    try:
        yield importlib.import_module("gdskit.vllm")
    finally:
        sys.modules.pop("gdskit.vllm", None)
        gdskit.__dict__.pop("vllm", None)


def _load_config(extra):
    """vLLM's LoadConfig holding ``extra`` where vLLM is installed; else an object with the same
    two fields (LoadConfig lets any value of model_loader_extra_config through: its type is
    ``dict | TensorizerConfig``, and TensorizerConfig is ``Any`` at run time)."""
    if HAS_VLLM:
        from vllm.config.load import LoadConfig
        return LoadConfig(load_format="gdskit", model_loader_extra_config=extra)
    return SimpleNamespace(load_format="gdskit", model_loader_extra_config=extra)


@pytest.mark.parametrize("extra", [{"nope": 1}, {"max_inflight_bytes": 0}, {"max_inflight_bytes": "1GB"},
                                   {"max_inflight_bytes": True}, {1: 2, "nope": 3}])
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


@pytest.mark.parametrize("extra,budget", [(None, None), ({}, None), ({"max_inflight_bytes": None}, None),
                                          ({"max_inflight_bytes": 1 << 20}, 1 << 20),
                                          (MappingProxyType({"max_inflight_bytes": 4096}), 4096)])
def test_extra_config_taken(gdskit_vllm, extra, budget) -> None:
    loader = gdskit_vllm.GdskitModelLoader(_load_config(extra))
    assert loader.max_inflight_bytes == budget


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


@pytest.mark.parametrize("extra", [{"verify": 1}, {"verify": "sha256:" + "0" * 64}, {"verify": b"x"}])
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
