"""Fixture checkpoints and the launcher of the fan-out tests' ranks (tests/group/group_workers.py)."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
from rank_launch import run_ranks
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
PIECE = 64 << 10  # group_workers.PIECE


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def make_checkpoints(d: Path) -> dict[str, Any]:
    """The fixture checkpoints and what the ranks need to know about them."""
    g = torch.Generator().manual_seed(7)
    rep: dict[str, Any] = {
        "shared.big": torch.randn(300, 257, generator=g),                   # split into pieces
        "shared.norm": torch.randn(97, generator=g),
        "shared.scalar": torch.tensor(3.5),
        "shared.empty": torch.empty(0, 4),
        "shared.half": torch.randn(200, 130, generator=g).to(torch.bfloat16),
    }
    for i in range(24):  # small neighbours of mixed types
        rep[f"layer{i}.bias"] = torch.randn(50 + 13 * i, generator=g)
        rep[f"layer{i}.mask"] = torch.rand(31 + i, generator=g) > 0.5
        rep[f"layer{i}.index"] = torch.arange(7 * i + 3, dtype=torch.int64)
    for i in range(3):
        rep[f"block{i}.weight"] = torch.randn(180 + 40 * i, 111, generator=g)
    save_file(rep, str(d / "replicated.safetensors"))
    (d / "garbage.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{this is not a header ...}" * 4)

    shard_dir = d / "sharded"
    shard_dir.mkdir()
    shards = [  # uneven on purpose: one tiny file, one large, one medium
        {"tiny": torch.arange(5, dtype=torch.int32)},
        {f"big{i}": torch.randn(400, 150 + i, generator=g) for i in range(3)},
        {f"mid{i}": torch.randn(60, 70, generator=g).to(torch.float16) for i in range(5)},
    ]
    weight_map = {}
    for i, sd in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(sd, str(shard_dir / fname))
        weight_map.update({k: fname for k in sd})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    ckpt = _torch_checkpoint(g)
    torch.save(ckpt, str(d / "ckpt.pt"))
    _other_and_copies(d, rep, g)
    _rewritten(d / "ckpt.pt", d / "deflated.pt", deflate=lambda name: name.endswith(("/data/0", "/data/2")))
    _rewritten(d / "ckpt.pt", d / "damaged.pt", replace={"byteorder": b"\xff\xfe\xfd"})
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ckpt.values()
                if isinstance(t, torch.Tensor)}
    return {
        "replicated_names": list(rep),
        "replicated_total": sum(_nbytes(t) for t in rep.values()),
        "shared_total": sum(_nbytes(t) for k, t in rep.items() if k.startswith("shared")),
        "sharded_total": sum(_nbytes(t) for sd in shards for t in sd.values()),
        "torch_total": sum(storages.values()),
    }


def _torch_checkpoint(g: torch.Generator) -> dict[str, Any]:
    base = torch.randn(1000, generator=g)
    return {"base": base, "view": base[100:300], "w": torch.randn(300, 301, generator=g),
            "small": torch.arange(10, dtype=torch.int16), "step": 7}


def _other_and_copies(d: Path, rep: dict[str, Any], g: torch.Generator) -> None:
    """``other/``: replicated.safetensors and ckpt.pt with the same layout (names, types, shapes,
    offsets, pickle) and other values; ``copy/``: byte copies of both with another mtime."""
    (d / "other").mkdir()
    other = {k: (torch.rand(t.shape, generator=g) > 0.5 if t.dtype == torch.bool
                 else torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t)
             for k, t in rep.items()}
    save_file(other, str(d / "other" / "replicated.safetensors"))
    torch.save(_torch_checkpoint(g), str(d / "other" / "ckpt.pt"))  # same name: the same archive layout
    (d / "copy").mkdir()
    for name in ("replicated.safetensors", "ckpt.pt"):
        copied = d / "copy" / name
        shutil.copyfile(d / name, copied)
        os.utime(copied, ns=(1_000_000_000, 1_000_000_000))  # a copy on another node has its own mtime


def _rewritten(src: Path, dst: Path, deflate: Any = lambda name: False,
               replace: dict[str, bytes] | None = None) -> None:
    """``src``'s archive written again: records ``deflate`` picks deflated, records named in
    ``replace`` (by name under the archive's folder) holding other bytes; a valid zip either way."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = (replace or {}).get(info.filename.split("/", 1)[-1], zin.read(info))
            method = zipfile.ZIP_DEFLATED if deflate(info.filename) else zipfile.ZIP_STORED
            zout.writestr(info.filename, data, compress_type=method)


def launch(name: str, world: int, workdir: Path, backend: str = "gloo", killed: tuple[int, int] | None = None,
           timeout_s: float = 240) -> dict[int, Any]:
    """Run world ``name`` of group_workers.py on ``world`` ranks; {rank: {scenario: facts}}.

    Fails (AssertionError) if a rank exits with another status than 0 (``killed``: the rank a
    scenario kills on purpose and its status), hangs past ``timeout_s`` or reports nothing;
    every process is ended before returning.
    """
    exit_status = {killed[0]: killed[1]} if killed is not None else None
    return run_ranks(HERE / "group_workers.py", name, world, workdir, extra=(backend,), exit_status=exit_status,
                     timeout_s=timeout_s)


def facts_of(ranks: dict[int, Any], world: int, scenario: str) -> list[dict[str, Any]]:
    """Every rank's facts of ``scenario``, in rank order; fails where a rank did not run it or met
    something unexpected."""
    assert sorted(ranks) == list(range(world))
    facts = []
    for rank in sorted(ranks):
        f = ranks[rank].get(scenario)
        assert f is not None, f"rank {rank} did not run {scenario}"
        assert "unexpected" not in f, f"rank {rank}, {scenario}: {f['unexpected']}"
        facts.append(f)
    return facts


def assert_each_byte_read_once(facts: list[dict[str, Any]], total: int, balanced: bool = True) -> None:
    """The ranks' storage bytes add up to ``total`` (about 1/N each when ``balanced``); peer bytes
    are in the ``peer`` path, came from other ranks, over gloo or NCCL."""
    world = len(facts)
    assert sum(f["storage"] for f in facts) == total  # every byte from storage, and only once
    for rank, f in enumerate(facts):
        if balanced:
            assert abs(f["storage"] - total / world) <= PIECE, (rank, f["storage"], total)
        assert f["peer"] == f["peer_path"]
        assert "peer" in f["paths"]
        assert all(src.split("/")[1] in ("gloo", "nccl") and int(src.split("/")[0]) != rank for src in f["sources"])
        assert sum(f["sources"].values()) == f["peer"]


def assert_failed(facts: list[dict[str, Any]], failing: int | None, own_error: str | None) -> None:
    """Rank ``failing`` raised ``own_error``, every other rank GroupError naming it."""
    for rank, f in enumerate(facts):
        if rank == failing:
            assert own_error in f["raised"], f
        else:
            assert "GroupError" in f["raised"] and "RuntimeError" in f["raised"], f
            if failing is not None:
                assert f["ranks"] == [failing], f
