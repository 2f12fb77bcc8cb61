"""gdskit.dcp on an object prefix (``s3://bucket/ckpt/``) of moto's S3 server: a checkpoint saved
there loads through gdskit's reader and, downloaded as it is, through torch's own
FileSystemReader; a failed save leaves no checkpoint and no pending upload; a hostile
``.metadata`` object is refused as a file is."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import gdskit  # noqa: E402
import gdskit.dcp  # noqa: E402
from gdskit.errors import FormatError  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

from object_server import fault_proxy, moto_endpoint, s3  # noqa: E402, F401 - fixtures

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _small_parts():
    with gdskit.settings.set(s3_part_size="5MiB", s3_concurrency=4, s3_max_retries=0):
        yield


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "big": torch.randn(3_000_000, generator=g),                    # 12 MiB: a multipart upload
        "w": torch.randn(512, 1024, generator=g),                      # 2 MiB: a large item
        "bf": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-100, 100, (9, 3), generator=g, dtype=torch.int8),
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(6, 10, generator=g).t(),
        "window": torch.arange(5000, dtype=torch.int32)[1000:3000],
        "opt": {"step": 12, "lr": 0.5, "name": "adamw"},
        "blob": io.BytesIO(b"raw bytes item" * 100),
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = io.BytesIO()
    return out


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, k
            assert torch.equal(g, w), k
        elif isinstance(w, io.BytesIO):
            g.seek(0)
            assert g.read() == w.getvalue(), k
        else:
            assert g == w, k


def _load(sd: dict[str, Any], reader: Any) -> dict[str, Any]:
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _download(s3: Any, prefix: str, into: Path) -> list[str]:
    """Every object under ``prefix`` as a file of ``into`` (the test's own boto3 client)."""
    into.mkdir()
    names = []
    for key in s3.keys():
        if key.startswith(prefix):
            name = key[len(prefix):]
            (into / name).write_bytes(s3.get(key))
            names.append(name)
    return sorted(names)


def test_saved_to_a_prefix_loads_with_gdskit_and_with_torchs_reader(s3: Any, tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(s3.url("run/step_1/")), no_dist=True)
    assert s3.pending_uploads() == []
    before = gdskit.stats()
    got = _load(_zeros_like(sd), gdskit.dcp.StorageReader(s3.url("run/step_1")))
    reads = [o for o in (gdskit.stats() - before).objects if o.op == "read"]
    _assert_same(got, sd)
    assert sum(o.bytes for o in reads) >= sd["big"].numel() * 4  # the items came through the engine
    assert _download(s3, "run/step_1/", tmp_path / "copy") == [".metadata", "__0_0.distcp"]
    _assert_same(_load(_zeros_like(sd), dcp.FileSystemReader(tmp_path / "copy")), sd)


def test_a_checkpoint_saved_by_torch_loads_from_a_prefix(s3: Any, tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "c", single_file_per_rank=True), no_dist=True)
    for name in os.listdir(tmp_path / "c"):
        s3.put("stock/" + name, (tmp_path / "c" / name).read_bytes())
    _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(s3.url("stock/"))), sd)


class _Boom(Exception):
    pass


class _FailingPlanner(DefaultSavePlanner):
    """Fails while the rank's file is being written, after the multipart upload has parts."""

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "w":
            raise _Boom("failure while writing")
        return super().resolve_data(write_item)


def _failures(exc: BaseException) -> list[BaseException]:
    fails = getattr(exc, "failures", None) or getattr(exc, "_failures", None) or {}
    return [e[0] if isinstance(e, tuple) else e for e in fails.values()]


def test_a_failure_mid_save_leaves_no_checkpoint_and_no_upload(s3: Any) -> None:
    sd = _state()
    url = s3.url("ckpt/")
    dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(url), no_dist=True)  # a complete one first
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(url), planner=_FailingPlanner(), no_dist=True)
    assert any(isinstance(e, _Boom) for e in _failures(info.value))
    assert "ckpt/.metadata" not in s3.keys()
    assert s3.pending_uploads() == []
    with pytest.raises(gdskit.dcp.IncompleteCheckpointError):
        gdskit.dcp.StorageReader(url).read_metadata()


def test_a_failed_part_upload_leaves_no_checkpoint_and_no_upload(s3: Any, fault_proxy: Any, tmp_path: Path) -> None:
    fault_proxy.fail_part_uploads = 1
    sd = _state()
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(s3.url("faulty/")), no_dist=True)
    assert any(isinstance(e, gdskit.errors.ObjectStoreError) for e in _failures(info.value))
    assert fault_proxy.fail_part_uploads == 0
    assert [k for k in s3.keys() if k.startswith("faulty/")] == []
    assert s3.pending_uploads() == []
    with pytest.raises(FileNotFoundError):
        gdskit.dcp.StorageReader(s3.url("faulty/")).read_metadata()


def test_overwrite_false_refuses_a_prefix_holding_a_checkpoint(s3: Any) -> None:
    sd = {"w": torch.arange(6.0)}
    dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(s3.url("once/")), no_dist=True)
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(s3.url("once/"), overwrite=False), no_dist=True)
    assert any(isinstance(e, gdskit.dcp.CheckpointExistsError) for e in _failures(info.value)) or isinstance(
        info.value, gdskit.dcp.CheckpointExistsError)
    assert torch.equal(_load({"w": torch.zeros(6)}, gdskit.dcp.StorageReader(s3.url("once/")))["w"], sd["w"])


def test_overwrite_false_asks_for_the_metadata_object_alone(s3: Any, fault_proxy: Any) -> None:
    for i in range(30):
        s3.put(f"busy/other_{i}", b"not a checkpoint")
    sd = {"w": torch.arange(6.0)}
    dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(s3.url("busy/"), overwrite=False), no_dist=True)
    assert not [p for m, p in fault_proxy.requests if m == "GET" and "list-type" in p]  # one HEAD, no listing
    assert [p for m, p in fault_proxy.requests if m == "HEAD" and p.split("?")[0].endswith("/busy/.metadata")]
    assert torch.equal(_load({"w": torch.zeros(6)}, gdskit.dcp.StorageReader(s3.url("busy/")))["w"], sd["w"])


def test_overwrite_false_where_the_store_refuses_the_head_is_a_permission_error(s3: Any, fault_proxy: Any) -> None:
    fault_proxy.refuse_heads = 1
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.arange(6.0)}, storage_writer=gdskit.dcp.StorageWriter(s3.url("shut/"), overwrite=False),
                 no_dist=True)
    assert any(isinstance(e, gdskit.errors.GdskitPermissionError) for e in _failures(info.value)) or isinstance(
        info.value, gdskit.errors.GdskitPermissionError)
    assert [k for k in s3.keys() if k.startswith("shut/")] == []


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("payload", ["call", "call inside metadata", "not metadata", "garbage"])
def test_a_hostile_metadata_object_runs_nothing_and_is_a_format_error(s3: Any, tmp_path: Path, payload: str) -> None:
    url = s3.url("hostile/")
    dcp.save({"w": torch.arange(6.0)}, storage_writer=gdskit.dcp.StorageWriter(url), no_dist=True)
    marker = str(tmp_path / "ran")
    good = gdskit.dcp.StorageReader(url).read_metadata()
    if payload == "call":
        blob = pickle.dumps(_Planted(marker))
    elif payload == "call inside metadata":
        good.planner_data = {"x": _Planted(marker)}
        blob = pickle.dumps(good)
    elif payload == "not metadata":
        blob = pickle.dumps({"not": "metadata"})
    else:
        blob = pickle.dumps(good)[:40] + b"\xff" * 20
    s3.put("hostile/.metadata", blob)
    with pytest.raises(FormatError):
        gdskit.dcp.StorageReader(url).read_metadata()
    assert not os.path.exists(marker)


def test_an_item_past_the_end_of_its_object_is_refused(s3: Any) -> None:
    url = s3.url("short/")
    dcp.save({"a": torch.randn(300_000)}, storage_writer=gdskit.dcp.StorageWriter(url), no_dist=True)
    data = s3.get("short/__0_0.distcp")
    s3.put("short/__0_0.distcp", data[:len(data) // 2])
    with pytest.raises(BaseException) as info:
        _load({"a": torch.zeros(300_000)}, gdskit.dcp.StorageReader(url))
    assert any(isinstance(e, FormatError) for e in _failures(info.value))


def test_digests_and_verify_are_refused_on_a_prefix_at_once(s3: Any) -> None:
    """A prefix's checkpoint has no digest manifest: asking for one is an error before any work."""
    from gdskit.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        gdskit.dcp.StorageWriter(s3.url("ckpt/"), digests=True)
    with pytest.raises(InvalidArgumentError):
        gdskit.dcp.StorageReader(s3.url("ckpt/"), verify=True)
    assert s3.keys() == []
