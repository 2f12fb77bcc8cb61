"""Fan-out loading over a gloo process group, 2 and 4 ranks (tests/group/group_workers.py runs the ranks).

One launch per world runs every scenario in order; each rank reports facts and the tests
here assert on every rank's: tensors equal to what safetensors / torch.load give, each
byte read from storage by exactly one rank (the sums of the ranks' ledgers), about 1/N
per rank, bytes from peers in the ledger's ``peer`` path with their sender, and failures
raised on every rank (the failing rank its own error, the others GroupError).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from group_launch import (assert_each_byte_read_once, assert_failed, facts_of, launch,  # noqa: E402
                          make_checkpoints)

WORLDS = {"two": 2, "four": 4}
ALONE = "one"  # a group of one rank
#: Exit status of a rank a scenario kills on purpose.
KILLED = {"four": (3, 17)}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("fanout")
    manifest = make_checkpoints(workdir)
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    out: dict[str, Any] = {"manifest": manifest}
    for name, world in WORLDS.items():
        out[name] = launch(name, world, workdir, killed=KILLED.get(name))
    out[ALONE] = launch(ALONE, 1, workdir)
    return out


def _facts(runs: dict[str, Any], world_name: str, scenario: str) -> list[dict[str, Any]]:
    return facts_of(runs[world_name], WORLDS[world_name], scenario)


@pytest.mark.parametrize("world_name", list(WORLDS))
@pytest.mark.parametrize("scenario", ["replicated", "replicated_after_failures"])
def test_replicated_load_reads_each_byte_once(runs: dict[str, Any], world_name: str, scenario: str) -> None:
    facts = _facts(runs, world_name, scenario)
    total = runs["manifest"]["replicated_total"]
    for f in facts:
        assert f["differs"] == ""
        assert f["peer"] == total - f["storage"]  # what a rank did not read, it received
    assert_each_byte_read_once(facts, total)


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_sharded_uneven_checkpoint_through_its_index(runs: dict[str, Any], world_name: str) -> None:
    facts = _facts(runs, world_name, "sharded")
    total = runs["manifest"]["sharded_total"]
    for f in facts:
        assert f["differs"] == ""
        assert f["peer"] == total - f["storage"]
    assert_each_byte_read_once(facts, total)


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_per_rank_keys(runs: dict[str, Any], world_name: str) -> None:
    """Every tensor is wanted by some rank: all are read once; only the shared ones travel."""
    facts = _facts(runs, world_name, "keys")
    m = runs["manifest"]
    for f in facts:
        assert f["differs"] == ""
        assert 0 < f["peer"] <= m["shared_total"]  # a tensor only one rank wants never travels
    assert_each_byte_read_once(facts, m["replicated_total"], balanced=False)


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_torch_load(runs: dict[str, Any], world_name: str) -> None:
    facts = _facts(runs, world_name, "torch_load")
    for f in facts:
        assert f["differs"] == "" and f["step"] == 7 and f["views_shared"]
    assert_each_byte_read_once(facts, runs["manifest"]["torch_total"])


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_bad_file_on_one_rank_raises_on_every_rank(runs: dict[str, Any], world_name: str) -> None:
    facts = _facts(runs, world_name, "bad_file_on_last_rank")
    assert_failed(facts, WORLDS[world_name] - 1, "FormatError")
    assert facts[-1]["path"] == "garbage.safetensors"  # the error names the file at fault


def test_missing_key_on_one_rank_raises_on_every_rank(runs: dict[str, Any]) -> None:
    assert_failed(_facts(runs, "two", "missing_key_on_rank_zero"), 0, "MissingTensorError")


def test_ranks_loading_different_checkpoints_all_raise(runs: dict[str, Any]) -> None:
    assert_failed(_facts(runs, "two", "other_checkpoint_on_rank_one"), None, None)


@pytest.mark.parametrize("scenario", ["other_values_on_rank_one", "other_torch_values_on_rank_one",
                                      "other_torch_values_loaded_alone"])
def test_same_layout_other_values_is_refused_on_every_rank(runs: dict[str, Any], scenario: str) -> None:
    """Files alike in every name, type, shape and offset but not in their values are not the same
    checkpoint: every rank raises GroupError, none returns the other rank's values."""
    facts = _facts(runs, "two", scenario)
    assert_failed(facts, None, None)


@pytest.mark.parametrize("scenario, total", [("copy_on_rank_one", "replicated_total"),
                                             ("torch_copy_on_rank_one", "torch_total")])
def test_a_copy_of_the_same_file_loads(runs: dict[str, Any], scenario: str, total: str) -> None:
    """Another path and another mtime, the same bytes: the same checkpoint (a node-local copy)."""
    facts = _facts(runs, "two", scenario)
    for f in facts:
        assert f["differs"] == ""
    assert_each_byte_read_once(facts, runs["manifest"][total])


def test_deflated_torch_archive_loads_as_torch_load(runs: dict[str, Any]) -> None:
    """Deflated storage records are inflated as gdskit.torch.load inflates them, not read as they lie."""
    for f in _facts(runs, "two", "torch_deflated"):
        assert f["differs"] == "" and f["step"] == 7 and f["views_shared"], f


def test_damaged_torch_archive_is_refused_on_every_rank(runs: dict[str, Any]) -> None:
    """A byteorder record that is not text: FormatError on each rank, as gdskit.torch.load refuses it."""
    for f in _facts(runs, "two", "torch_damaged"):
        assert "FormatError" in f["raised"], f


@pytest.mark.parametrize("world_name", list(WORLDS))
def test_failure_during_the_load_raises_on_every_rank(runs: dict[str, Any], world_name: str) -> None:
    assert_failed(_facts(runs, world_name, "callback_raises_on_last_rank"), WORLDS[world_name] - 1, "Stop")


def test_killed_rank_makes_the_others_raise(runs: dict[str, Any]) -> None:
    facts = _facts(runs, "four", "killed_last_rank")
    assert facts[3] == {"died": True}
    for f in facts[:3]:
        assert "GroupError" in f["raised"], f


def test_stalled_rank_makes_the_others_raise_at_the_timeout(runs: dict[str, Any]) -> None:
    facts = _facts(runs, "two", "stalled_last_rank")
    assert "GroupError" in facts[0]["raised"], facts[0]


@pytest.mark.parametrize("scenario, total", [("replicated", "replicated_total"), ("keys", "replicated_total"),
                                             ("torch_load", "torch_total")])
def test_a_group_of_one_reads_everything_itself(runs: dict[str, Any], scenario: str, total: str) -> None:
    (f,) = facts_of(runs[ALONE], 1, scenario)
    assert f["differs"] == ""
    assert f["storage"] == runs["manifest"][total] and f["peer"] == 0 and "peer" not in f["paths"]
