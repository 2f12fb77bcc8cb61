"""Fan-out loading into GPU memory (needs a GPU): two ranks over gloo with GPU tensors on one GPU,
and over NCCL where there is a GPU per rank. The same scenarios and facts as tests/group/test_group_fanout.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402

from group_launch import assert_each_byte_read_once, assert_failed, facts_of, launch, make_checkpoints  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

BACKENDS = ["gloo", "cpu:gloo,cuda:nccl"]


@pytest.fixture(scope="module", params=BACKENDS)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not dist.is_available() or not torch.cuda.is_available():
        pytest.skip("torch.distributed and a CUDA GPU are needed")
    if "nccl" in request.param and (torch.cuda.device_count() < 2 or not dist.is_nccl_available()):
        pytest.skip("NCCL needs a GPU per rank: two GPUs")
    workdir = tmp_path_factory.mktemp("fanout_gpu")
    manifest = make_checkpoints(workdir)
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    return {"manifest": manifest, "ranks": launch("gpu", 2, workdir, backend=request.param),
            "backend": "nccl" if "nccl" in request.param else "gloo"}


@pytest.mark.parametrize("scenario, total", [("replicated", "replicated_total"), ("sharded", "sharded_total"),
                                             ("torch_load", "torch_total"),
                                             ("replicated_after_failures", "replicated_total")])
def test_loads_into_gpu_memory(run: dict[str, Any], scenario: str, total: str) -> None:
    facts = facts_of(run["ranks"], 2, scenario)
    for f in facts:
        assert f["differs"] == ""
        assert all(src.endswith("/" + run["backend"]) for src in f["sources"])
    assert_each_byte_read_once(facts, run["manifest"][total])


def test_per_rank_keys_into_gpu_memory(run: dict[str, Any]) -> None:
    facts = facts_of(run["ranks"], 2, "keys")
    for f in facts:
        assert f["differs"] == ""
    assert_each_byte_read_once(facts, run["manifest"]["replicated_total"], balanced=False)


def test_bad_file_on_one_rank(run: dict[str, Any]) -> None:
    assert_failed(facts_of(run["ranks"], 2, "bad_file_on_last_rank"), 1, "FormatError")
