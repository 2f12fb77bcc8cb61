"""torch.distributed.checkpoint through gdskit with several ranks (gloo on CPU).

Three worlds run one after another on the same directory tree: 2 ranks (save,
load, interop both ways, async save, a rank failing in write_data), 4 ranks
(load the 2-rank checkpoints, save new ones), 2 ranks (load the 4-rank ones).
Each rank compares the tensors it loaded with the values they must hold and
reports; the tests assert on every rank's report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed.checkpoint")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from dcp_launch import run_world  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    workdir = tmp_path_factory.mktemp("dcp_multi")
    out = {"first": run_world("first", 2, workdir)}
    out["wide"] = run_world("wide", 4, workdir)
    out["narrow"] = run_world("narrow", 2, workdir)
    out["_dir"] = workdir  # type: ignore[assignment]
    return out


def _assert_all_ranks(report: dict[int, Any], check: str, world: int) -> None:
    assert sorted(report) == list(range(world))
    for rank, checks in report.items():
        assert check in checks, f"rank {rank} did not run {check}"
        assert checks[check]["ok"], f"rank {rank}, {check}: {checks[check]['detail']}"


@pytest.mark.parametrize("check", ["save_gdskit", "load_gdskit", "async_save", "save_digests", "load_verified"])
def test_save_load_two_ranks(worlds: dict[str, Any], check: str) -> None:
    _assert_all_ranks(worlds["first"], check, 2)


@pytest.mark.parametrize("check", ["gdskit_to_stock", "save_stock", "stock_to_gdskit"])
def test_interop_with_stock_two_ranks(worlds: dict[str, Any], check: str) -> None:
    _assert_all_ranks(worlds["first"], check, 2)


@pytest.mark.parametrize("check", ["fail_raises", "fail_raises_checkpoint_exception", "fail_nothing_visible",
                                   "fail_reader_refuses", "fail_stock_refuses", "fail_previous_intact"])
def test_rank_failing_in_write_data(worlds: dict[str, Any], check: str) -> None:
    _assert_all_ranks(worlds["first"], check, 2)


@pytest.mark.parametrize("check", ["reshard_2_4_gdskit", "reshard_2_4_stock_written", "reshard_2_4_verified",
                                   "save_gdskit_4", "save_stock_4", "save_digests_4"])
def test_reshard_two_to_four(worlds: dict[str, Any], check: str) -> None:
    _assert_all_ranks(worlds["wide"], check, 4)


@pytest.mark.parametrize("check", ["reshard_4_2_gdskit", "reshard_4_2_verified", "reshard_4_2_gdskit_to_stock",
                                   "reshard_4_2_stock_to_gdskit"])
def test_reshard_four_to_two(worlds: dict[str, Any], check: str) -> None:
    _assert_all_ranks(worlds["narrow"], check, 2)


def test_layout_on_disk(worlds: dict[str, Any]) -> None:
    """One file per rank with stock names, no temporary files, large payloads 4 KiB-aligned."""
    import gdskit.dcp
    from gdskit.dcp import _archive
    ckpt = Path(worlds["_dir"]) / "ckpt"
    for name, world in (("g2", 2), ("g4", 4), ("a2", 2)):
        files = sorted(p.name for p in (ckpt / name).iterdir())
        assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]
    md = gdskit.dcp.StorageReader(ckpt / "g4").read_metadata()
    big = [(idx, info) for idx, info in md.storage_data.items() if idx.fqn == "big"]
    assert len(big) == 4
    for _idx, info in big:
        with open(ckpt / "g4" / info.relative_path, "rb") as fh:
            fh.seek(info.offset)
            blob = fh.read(info.length)
        with open(ckpt / "g4" / info.relative_path, "rb") as fh:
            saved = _archive.parse(lambda off, n: os.pread(fh.fileno(), n, off), info.offset, info.length,
                                   blob[:4096], blob[-8192:], "t")
        assert saved.record_offset % 4096 == 0
        assert saved.record_nbytes == 256 * 1024 * 4


def test_digests_of_every_rank_file_in_one_manifest(worlds: dict[str, Any]) -> None:
    """The coordinator writes one manifest listing each rank's file, its items and their digests."""
    from gdskit.verify import DIRECTORY_MANIFEST, read_manifest
    ckpt = Path(worlds["_dir"]) / "ckpt"
    for name, world in (("d2", 2), ("d4", 4)):
        assert sorted(p.name for p in (ckpt / name).iterdir()) == (
            [".metadata"] + [f"__{r}_0.distcp" for r in range(world)] + [DIRECTORY_MANIFEST])
        manifest = read_manifest(ckpt / name / DIRECTORY_MANIFEST)
        assert sorted(manifest.files) == [f"__{r}_0.distcp" for r in range(world)]
        assert all(f.tensors for f in manifest.files.values())
