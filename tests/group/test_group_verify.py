"""``verify=`` with ``process_group=``: 2 gloo ranks (tests/group/group_workers.py, world "verify").

Every rank checks the bytes it holds after the fan-out; a flipped byte raises
ChecksumMismatchError on every rank (also where only one rank holds the tensor), none hangs.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import gdskit.safetensors as gs  # noqa: E402
from gdskit.formats.digest_scan import make_manifests  # noqa: E402
from group_launch import facts_of, launch, make_checkpoints  # noqa: E402

WORLD = 2
FLIPPED = "w.middle"  # the tensor whose byte is flipped; more than one piece (64 KiB) long

pytestmark = pytest.mark.timeout(300)


def _data_offset(path: Path, name: str) -> int:
    """The file offset of tensor ``name``'s first byte."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    return 8 + n + header[name]["data_offsets"][0]


def _make_verify_fixtures(d: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    tensors = {"w.first": torch.randn(70, 300, generator=g), FLIPPED: torch.randn(200, 257, generator=g),
               "w.half": torch.randn(90, 33, generator=g).to(torch.bfloat16), "w.empty": torch.empty(0, 3),
               "w.index": torch.arange(41, dtype=torch.int64), "w.last": torch.randn(5000, generator=g)}
    gs.save_file(tensors, str(d / "digested.safetensors"), digests=True)
    flipped = d / "flipped.safetensors"
    shutil.copyfile(d / "digested.safetensors", flipped)
    at = _data_offset(flipped, FLIPPED) + 100_000  # in the tensor's second piece
    with open(flipped, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x10]))

    shards = d / "digested_sharded"
    shards.mkdir()
    weight_map = {}
    for i, part in enumerate(({"a": torch.randn(300, 100, generator=g)}, {"b": torch.randn(64, generator=g),
                                                                          "c": torch.randn(100, 90, generator=g)})):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        gs.save_file(part, str(shards / fname))  # no digests in the header: the directory's manifest has them
        weight_map.update({k: fname for k in part})
    (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    make_manifests([str(shards)])
    for name in ("torch_digested", "torch_flipped"):
        (d / name).mkdir()
        shutil.copyfile(d / "ckpt.pt", d / name / "ckpt.pt")
        make_manifests([str(d / name)])
    flipped_pt = d / "torch_flipped" / "ckpt.pt"
    raw = bytearray(flipped_pt.read_bytes())
    w = torch.load(str(flipped_pt), weights_only=True)["w"]
    at = raw.find(w.numpy().tobytes()[:256]) + 200_000  # inside the storage of "w", "data/<key>"
    raw[at] ^= 0x01
    st = flipped_pt.stat()
    flipped_pt.write_bytes(bytes(raw))
    os.utime(flipped_pt, ns=(st.st_atime_ns, st.st_mtime_ns))  # corruption, not a newer version of the file
    return {"digested_names": list(tensors), "flipped_tensor": FLIPPED,
            "digested_total": sum(t.numel() * t.element_size() for t in tensors.values())}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    workdir = tmp_path_factory.mktemp("group_verify")
    manifest = make_checkpoints(workdir)
    manifest.update(_make_verify_fixtures(workdir))
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    return {"manifest": manifest, **launch("verify", WORLD, workdir, timeout_s=180)}


def _facts(ranks: dict[Any, Any], scenario: str) -> list[dict[str, Any]]:
    return facts_of({r: f for r, f in ranks.items() if r != "manifest"}, WORLD, scenario)


@pytest.mark.parametrize("scenario", ["verified", "verified_keys", "verified_sharded", "verified_after_failures"])
def test_verified_group_load_equals_the_plain_load_on_every_rank(ranks: dict[Any, Any], scenario: str) -> None:
    facts = _facts(ranks, scenario)
    for f in facts:
        assert f["differs"] == "" and f["differs_from_plain"] == ""
        assert f["verified"] == f["held"]  # every byte the rank holds was checked where it landed, once
    if scenario != "verified_keys":
        assert sum(f["storage"] for f in facts) == facts[0]["held"]  # still read once by the group
        assert all(f["peer"] > 0 for f in facts)


@pytest.mark.parametrize("scenario", ["flipped", "flipped_where_only_rank_zero_looks"])
def test_a_flipped_byte_raises_checksum_mismatch_on_every_rank(ranks: dict[Any, Any], scenario: str) -> None:
    for f in _facts(ranks, scenario):
        assert "ChecksumMismatchError" in f["raised"] and "ValueError" in f["raised"], f
        assert f["path"] == "flipped.safetensors"
        assert f["tensor"] == FLIPPED
        assert f["expected"] != f["actual"]


def test_nothing_to_verify_is_refused_on_every_rank(ranks: dict[Any, Any]) -> None:
    for f in _facts(ranks, "nothing_to_verify"):
        assert "NothingToVerifyError" in f["raised"], f


def test_ranks_that_do_not_all_verify_are_refused(ranks: dict[Any, Any]) -> None:
    for f in _facts(ranks, "verify_on_rank_zero_only"):
        assert "GroupError" in f["raised"], f


def test_torch_load_verified_over_the_group(ranks: dict[Any, Any]) -> None:
    facts = _facts(ranks, "torch_verified")
    for f in facts:
        assert f["differs"] == "" and f["step"] == 7
        assert f["verified"] == ranks["manifest"]["torch_total"]  # every storage record, on every rank
    assert sum(f["storage"] for f in facts) == ranks["manifest"]["torch_total"]


def test_torch_load_flipped_byte_raises_on_every_rank(ranks: dict[Any, Any]) -> None:
    for f in _facts(ranks, "torch_flipped"):
        assert "ChecksumMismatchError" in f["raised"], f
        assert f["path"] == "ckpt.pt" and f["tensor"].startswith("data/")
