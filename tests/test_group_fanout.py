"""Fan-out loading over a gloo process group, 2 and 4 ranks (tests/group_workers.py runs the ranks).

One launch per world runs every scenario in order; each rank reports facts and the tests
here assert on every rank's: tensors equal to what safetensors / torch.load give, each
byte read from storage by exactly one rank (the sums of the ranks' ledgers), about 1/N
per rank, bytes from peers in the ledger's ``peer`` path with their sender, and failures
raised on every rank (the failing rank its own error, the others GroupError).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import save_file  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
PIECE = 64 << 10  # group_workers.PIECE
WORLDS = {"two": 2, "four": 4}
#: Exit status of a rank a scenario kills on purpose.
KILLED = {"four": (3, 17)}

pytestmark = pytest.mark.timeout(300)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _checkpoints(d: Path) -> dict[str, Any]:
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

    base = torch.randn(1000, generator=g)
    ckpt = {"base": base, "view": base[100:300], "w": torch.randn(300, 301, generator=g),
            "small": torch.arange(10, dtype=torch.int16), "step": 7}
    torch.save(ckpt, str(d / "ckpt.pt"))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ckpt.values()
                if isinstance(t, torch.Tensor)}
    return {
        "replicated_names": list(rep),
        "replicated_total": sum(_nbytes(t) for t in rep.values()),
        "shared_total": sum(_nbytes(t) for k, t in rep.items() if k.startswith("shared")),
        "sharded_total": sum(_nbytes(t) for sd in shards for t in sd.values()),
        "torch_total": sum(storages.values()),
    }


def _launch(name: str, world: int, workdir: Path, timeout_s: float = 240) -> dict[int, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    procs, logs = [], []
    for rank in range(world):
        log = open(workdir / f"{name}.{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "group_workers.py"), name, str(rank), str(world),
                                       str(workdir)], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    out: dict[int, Any] = {}
    problems = []
    for rank, p in enumerate(procs):
        expected = KILLED[name][1] if KILLED.get(name, (None,))[0] == rank else 0
        report = workdir / f"{name}.{rank}.json"
        if p.returncode != expected or not report.exists():
            tail = (workdir / f"{name}.{rank}.log").read_text()[-4000:]
            problems.append(f"rank {rank} exited with {p.returncode} (expected {expected}):\n{tail}")
            continue
        out[rank] = json.loads(report.read_text())
    assert not problems, "\n".join(problems)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("fanout")
    manifest = _checkpoints(workdir)
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    out: dict[str, Any] = {"manifest": manifest}
    for name, world in WORLDS.items():
        out[name] = _launch(name, world, workdir)
    return out


def _facts(runs: dict[str, Any], world_name: str, scenario: str) -> list[dict[str, Any]]:
    ranks = runs[world_name]
    assert sorted(ranks) == list(range(WORLDS[world_name]))
    facts = []
    for rank in sorted(ranks):
        f = ranks[rank].get(scenario)
        assert f is not None, f"rank {rank} did not run {scenario}"
        assert "unexpected" not in f, f"rank {rank}, {scenario}: {f['unexpected']}"
        facts.append(f)
    return facts


def _assert_each_byte_read_once(facts: list[dict[str, Any]], total: int, balanced: bool = True) -> None:
    world = len(facts)
    assert sum(f["storage"] for f in facts) == total  # every byte from storage, and only once
    for rank, f in enumerate(facts):
        if balanced:
            assert abs(f["storage"] - total / world) <= PIECE, (rank, f["storage"], total)
        assert f["peer"] == f["peer_path"]
        assert "peer" in f["paths"]
        assert all(src.endswith("/gloo") and int(src.split("/")[0]) != rank for src in f["sources"])
        assert sum(f["sources"].values()) == f["peer"]


@pytest.mark.parametrize("world_name", list(WORLDS))
@pytest.mark.parametrize("scenario", ["replicated", "replicated_after_failures"])
def test_replicated_load_reads_each_byte_once(runs: dict[str, Any], world_name: str, scenario: str) -> None:
    facts = _facts(runs, world_name, scenario)
    total = runs["manifest"]["replicated_total"]
    for f in facts:
        assert f["differs"] == ""
        assert f["peer"] == total - f["storage"]  # what a rank did not read, it received
    _assert_each_byte_read_once(facts, total)


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_sharded_uneven_checkpoint_through_its_index(runs: dict[str, Any], world_name: str) -> None:
    facts = _facts(runs, world_name, "sharded")
    total = runs["manifest"]["sharded_total"]
    for f in facts:
        assert f["differs"] == ""
        assert f["peer"] == total - f["storage"]
    _assert_each_byte_read_once(facts, total)


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_per_rank_keys(runs: dict[str, Any], world_name: str) -> None:
    """Every tensor is wanted by some rank: all are read once; only the shared ones travel."""
    facts = _facts(runs, world_name, "keys")
    m = runs["manifest"]
    for f in facts:
        assert f["differs"] == ""
        assert 0 < f["peer"] <= m["shared_total"]  # a tensor only one rank wants never travels
    _assert_each_byte_read_once(facts, m["replicated_total"], balanced=False)


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_torch_load(runs: dict[str, Any], world_name: str) -> None:
    facts = _facts(runs, world_name, "torch_load")
    for f in facts:
        assert f["differs"] == "" and f["step"] == 7 and f["views_shared"]
    _assert_each_byte_read_once(facts, runs["manifest"]["torch_total"])


def _assert_failed(facts: list[dict[str, Any]], failing: int | None, own_error: str | None) -> None:
    for rank, f in enumerate(facts):
        if rank == failing:
            assert own_error in f["raised"], f
        else:
            assert "GroupError" in f["raised"] and "RuntimeError" in f["raised"], f
            if failing is not None:
                assert f["ranks"] == [failing], f


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_bad_file_on_one_rank_raises_on_every_rank(runs: dict[str, Any], world_name: str) -> None:
    _assert_failed(_facts(runs, world_name, "bad_file_on_last_rank"), WORLDS[world_name] - 1, "FormatError")


def test_missing_key_on_one_rank_raises_on_every_rank(runs: dict[str, Any]) -> None:
    _assert_failed(_facts(runs, "two", "missing_key_on_rank_zero"), 0, "MissingTensorError")


def test_ranks_loading_different_checkpoints_all_raise(runs: dict[str, Any]) -> None:
    _assert_failed(_facts(runs, "two", "other_checkpoint_on_rank_one"), None, None)


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_failure_during_the_load_raises_on_every_rank(runs: dict[str, Any], world_name: str) -> None:
    _assert_failed(_facts(runs, world_name, "callback_raises_on_last_rank"), WORLDS[world_name] - 1, "Stop")


def test_killed_rank_makes_the_others_raise(runs: dict[str, Any]) -> None:
    facts = _facts(runs, "four", "killed_last_rank")
    assert facts[3] == {"died": True}
    for f in facts[:3]:
        assert "GroupError" in f["raised"], f


def test_stalled_rank_makes_the_others_raise_at_the_timeout(runs: dict[str, Any]) -> None:
    facts = _facts(runs, "two", "stalled_last_rank")
    assert "GroupError" in facts[0]["raised"], facts[0]
