"""gdskit.dcp with tensors on the GPU: one process per GPU (one rank on a single-GPU machine).

Runs unchanged on a multi-GPU host: every rank uses ``cuda:{rank % device_count}``
with NCCL for CUDA tensors and gloo for CPU objects; a single rank uses gloo.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gpu_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp_gpu")


@pytest.fixture(scope="module")
def gpu_world(gpu_workdir: Path) -> tuple[int, dict[int, Any]]:
    from gdskit.engine import cuda
    from dcp_launch import run_world
    world = max(1, cuda.device_count())
    return world, run_world("gpu", world, gpu_workdir, device="cuda")


@pytest.fixture(scope="module")
def gpu_one_rank(gpu_world: tuple[int, dict[int, Any]], gpu_workdir: Path) -> dict[int, Any]:
    """The checkpoints every GPU's rank wrote, loaded by one rank (resharded where there were several)."""
    from dcp_launch import run_world
    return run_world("gpu_one", 1, gpu_workdir, device="cuda")


@pytest.mark.parametrize("check", ["gpu_save", "gpu_load", "gpu_gdskit_to_stock", "gpu_save_stock",
                                   "gpu_stock_to_gdskit", "gpu_async_save", "gpu_ledger"])
def test_gpu_ranks(gpu_world: tuple[int, dict[int, Any]], check: str) -> None:
    world, report = gpu_world
    assert sorted(report) == list(range(world))
    for rank, checks in report.items():
        assert checks[check]["ok"], f"rank {rank}, {check}: {checks[check]['detail']}"


def test_gpu_ledger_names_device_paths(gpu_world: tuple[int, dict[int, Any]]) -> None:
    """The payload left and reached GPU memory through a device path (cuFile or bounce), not the host path."""
    _world, report = gpu_world
    detail = json.loads(report[0]["gpu_ledger"]["detail"])
    device_paths = {"cufile-nvfs", "cufile-p2pdma", "cufile-compat", "bounce-cached", "bounce-direct"}
    assert device_paths & set(detail["save"]), detail
    assert device_paths & set(detail["load"]), detail


@pytest.mark.parametrize("check", ["gpu_reshard_one_rank", "gpu_stock_reshard_one_rank"])
def test_gpu_checkpoint_loads_on_one_rank(gpu_one_rank: dict[int, Any], check: str) -> None:
    assert gpu_one_rank[0][check]["ok"], gpu_one_rank[0][check]["detail"]
