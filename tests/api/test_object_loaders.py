"""Loaders reading s3:// URLs from moto's S3 server: the tensors equal what safetensors' own
``load_file`` gives for the same file on disk (one object, a prefix with its index, a prefix of
shards); ``load_into`` and ``iter_tensors`` read the same; the data loader's preload too."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

import gdskit  # noqa: E402
import gdskit.safetensors as gst  # noqa: E402
from gdskit.errors import FormatError, GdskitFileNotFoundError  # noqa: E402

from object_server import moto_endpoint, s3  # noqa: E402, F401 - fixtures

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _small_parts():
    with gdskit.settings.set(s3_part_size="5MiB", s3_concurrency=4):
        yield


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{seed}.w": torch.randn(700, 1100, generator=g),          # about 3 MiB
            f"layer{seed}.b": torch.randn(1100, generator=g).to(torch.bfloat16),
            f"layer{seed}.i": torch.randint(0, 100, (3, 5), generator=g, dtype=torch.int64),
            f"layer{seed}.empty": torch.empty(0, 4)}


def _upload_file(s3, tmp_path, key: str, tensors: dict[str, torch.Tensor]) -> str:
    local = tmp_path / key.replace("/", "_")
    st_torch.save_file(tensors, str(local))
    s3.put(key, local.read_bytes())
    return str(local)


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert torch.equal(got[name], want[name]), name


def test_load_file_of_one_object_equals_safetensors_own(s3, tmp_path):
    local = _upload_file(s3, tmp_path, "model.safetensors", {**_tensors(1), **_tensors(2)})
    got = gst.load_file(s3.url("model.safetensors"))
    _assert_same(got, st_torch.load_file(local))
    some = gst.load_file(s3.url("model.safetensors"), keys=["layer2.b"])
    assert list(some) == ["layer2.b"] and torch.equal(some["layer2.b"], st_torch.load_file(local)["layer2.b"])


def _sharded(s3, tmp_path, prefix: str, with_index: bool) -> dict:
    want = {}
    weight_map = {}
    for i in (1, 2):
        name = f"model-0000{i}-of-00002.safetensors"
        local = _upload_file(s3, tmp_path, prefix + name, _tensors(i))
        shard = st_torch.load_file(local)
        want.update(shard)
        weight_map.update({k: name for k in shard})
    if with_index:
        s3.put(prefix + "model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    return want


def test_load_file_of_a_prefix_with_its_index(s3, tmp_path):
    want = _sharded(s3, tmp_path, "repo/", with_index=True)
    s3.put("repo/sub/other.safetensors", b"not read")  # deeper objects are not the prefix's shards
    _assert_same(gst.load_file(s3.url("repo/")), want)
    _assert_same(gst.load_file(s3.url("repo/model.safetensors.index.json")), want)


def test_load_file_of_a_prefix_of_shards_without_index(s3, tmp_path):
    want = _sharded(s3, tmp_path, "plain/", with_index=False)
    _assert_same(gst.load_file(s3.url("plain/")), want)


def test_index_naming_a_missing_shard_and_empty_prefix(s3, tmp_path):
    s3.put("broken/model.safetensors.index.json",
           json.dumps({"weight_map": {"x": "model-00009-of-00009.safetensors"}}).encode())
    with pytest.raises(GdskitFileNotFoundError):
        gst.load_file(s3.url("broken/"))
    with pytest.raises(FormatError):
        gst.load_file(s3.url("nothing-here/"))


def test_truncated_object_is_a_format_error(s3, tmp_path):
    local = _upload_file(s3, tmp_path, "t.safetensors", _tensors(3))
    with open(local, "rb") as fh:
        s3.put("cut.safetensors", fh.read()[:-100])
    with pytest.raises(FormatError):
        gst.load_file(s3.url("cut.safetensors"))


def test_load_into_and_iter_tensors_read_the_same(s3, tmp_path):
    want = _sharded(s3, tmp_path, "into/", with_index=True)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    result = gst.load_into(target, s3.url("into/"))
    assert not result.missing_keys and not result.unexpected_keys
    _assert_same(target, want)
    streamed = dict(gst.iter_tensors(s3.url("into/"), device="cpu"))
    _assert_same(streamed, want)


def test_load_file_records_the_object_path(s3, tmp_path):
    _upload_file(s3, tmp_path, "s.safetensors", _tensors(4))
    _tensors_, delta = gst.load_file(s3.url("s.safetensors"), return_stats=True)
    assert set(delta.paths) == {"object"}
    assert delta.objects and all(o.endpoint == s3.endpoint for o in delta.objects)


def test_preload_of_a_prefix_equals_preload_of_the_same_directory(s3, tmp_path):
    from gdskit.data import preload

    local = tmp_path / "data"
    (local / "sub").mkdir(parents=True)
    rng = np.random.default_rng(7)
    np.save(local / "a.npy", rng.standard_normal((300, 70)).astype(np.float32))
    np.save(local / "sub" / "f.npy", np.asfortranarray(rng.integers(0, 9, (40, 30), dtype=np.int16)))
    (local / "raw.bin").write_bytes(rng.integers(0, 256, 6 * MiB + 1, dtype=np.uint8).tobytes())
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        s3.put("data/" + path.relative_to(local).as_posix(), path.read_bytes())
    want = preload(str(local), device="cpu")
    got = preload(s3.url("data/"), device="cpu")
    assert set(got) == set(want) == {"a.npy", "raw.bin", "sub/f.npy"}
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
        assert got[key].stride() == want[key].stride()
        assert torch.equal(got[key], want[key]), key
    one = preload(s3.url("data/a.npy"), device="cpu")
    assert torch.equal(one[s3.url("data/a.npy")], want["a.npy"])
    with pytest.raises(FileNotFoundError):
        preload(s3.url("nothing/"), device="cpu")


def test_torch_load_of_an_object_equals_torch_own(s3, tmp_path):
    import gdskit.torch as gtorch

    g = torch.Generator().manual_seed(11)
    state = {"w": torch.randn(800, 900, generator=g), "b": torch.arange(10, dtype=torch.int32),
             "nested": {"h": torch.randn(3, 4, generator=g).to(torch.float16)}, "step": 7}
    local = tmp_path / "ckpt.pt"
    torch.save(state, local)
    s3.put("ckpt.pt", local.read_bytes())
    got = gtorch.load(s3.url("ckpt.pt"))
    want = torch.load(local)
    assert got["step"] == want["step"] == 7
    for get in (lambda d: d["w"], lambda d: d["b"], lambda d: d["nested"]["h"]):
        assert get(got).dtype == get(want).dtype and torch.equal(get(got), get(want))
    with pytest.raises(FileNotFoundError):
        gtorch.load(s3.url("missing.pt"))


def test_safe_open_of_an_object_reads_tensors_and_slices(s3, tmp_path):
    local = _upload_file(s3, tmp_path, "so.safetensors", _tensors(5))
    want = st_torch.load_file(local)
    with gst.safe_open(s3.url("so.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(want)
        assert torch.equal(f.get_tensor("layer5.w"), want["layer5.w"])
        assert torch.equal(f.get_slice("layer5.w")[10:20, 3:7], want["layer5.w"][10:20, 3:7])
