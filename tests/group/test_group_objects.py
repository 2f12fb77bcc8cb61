"""Group loads of ``s3://`` checkpoints from moto's S3 server, 2 gloo ranks (tests/group/group_workers.py
runs them): each rank's tensors equal safetensors' (and torch.load's) own load of a local copy, the
object bytes of the tensors are read once across the ranks (the ledger's ``object`` path, summed
over the ranks) and the rest came from the peer."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from group_launch import facts_of, launch, make_checkpoints  # noqa: E402
from object_server import moto_endpoint, s3  # noqa: E402, F401 - fixtures

WORLD = 2

pytestmark = pytest.mark.timeout(300)


def _header_bytes(path: Path) -> int:
    """The bytes a rank reads to parse a safetensors file's header: the length and the JSON."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    return 8 + n


def _upload(s3: Any, workdir: Path) -> dict[str, str]:
    for name in ("replicated.safetensors", "ckpt.pt"):
        s3.put(f"ckpt/{name}", (workdir / name).read_bytes())
    s3.put("other/replicated.safetensors", (workdir / "other" / "replicated.safetensors").read_bytes())
    for f in sorted((workdir / "sharded").iterdir()):
        s3.put(f"sharded/{f.name}", f.read_bytes())
    return {"replicated": s3.url("ckpt/replicated.safetensors"), "sharded": s3.url("sharded/"),
            "torch": s3.url("ckpt/ckpt.pt"), "other": s3.url("other/replicated.safetensors")}


def test_a_group_reads_each_object_byte_once_and_fans_it_out(s3: Any, tmp_path: Path) -> None:
    manifest = make_checkpoints(tmp_path)
    manifest["objects"] = _upload(s3, tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    ranks = launch("objects", WORLD, tmp_path)

    headers = {"replicated": _header_bytes(tmp_path / "replicated.safetensors"),
               "sharded": sum(_header_bytes(f) for f in (tmp_path / "sharded").glob("*.safetensors"))
               + (tmp_path / "sharded" / "model.safetensors.index.json").stat().st_size}
    totals = {"replicated": manifest["replicated_total"], "sharded": manifest["sharded_total"]}
    for kind in ("replicated", "sharded"):
        facts = facts_of(ranks, WORLD, f"object_{kind}")
        for f in facts:
            assert f["differs"] == ""
            assert f["peer"] > 0 and "peer" in f["paths"]  # the other rank's share came over gloo
            assert f["storage"] == f["object"]  # every storage byte came from the store
        # each tensor byte from the store once across the ranks; each rank read the headers itself
        assert sum(f["object"] for f in facts) == totals[kind] + WORLD * headers[kind]
        assert sum(f["peer"] for f in facts) == (WORLD - 1) * totals[kind]

    for f in facts_of(ranks, WORLD, "object_torch"):
        assert f["differs"] == "" and f["step"] == 7
        assert f["peer"] > 0

    for f in facts_of(ranks, WORLD, "object_other_values_on_rank_one"):
        assert "GroupError" in f["raised"], f
