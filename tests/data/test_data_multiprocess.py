"""gdskit.data.Loader over gloo process groups of 1, 2 and 4 ranks (one launch of all three, every
scenario in each): ranks and world size from torch.distributed, every window exactly once per
epoch with equal counts, orders by seed and epoch, resume mid-prefetch, refused states."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from data_workers import FILE_STRIDE, SEQ_LEN, TOKENS, run_worlds, token_files, windows  # noqa: E402

pytestmark = pytest.mark.timeout(600)
WORLDS = (1, 2, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    workdir = tmp_path_factory.mktemp("data_multi")
    files = token_files(workdir / "tokens", TOKENS)
    out: dict[int, Any] = dict(run_worlds(WORLDS, workdir))
    out[0] = [int(w[0]) for w in windows(files, "uint32", SEQ_LEN)]  # every window's first token
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_and_world_come_from_the_process_group(runs, world):
    assert sorted(runs[world]) == list(range(world))
    for rank, rep in runs[world].items():
        assert rep["rank_world_False"][:2] == [rank, world]
        assert rep["len_dataset"] == len(runs[0])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_window_once_per_epoch_with_equal_counts(runs, world, drop_last):
    every = runs[0]
    n = len(every)
    reps = runs[world]
    for epoch in range(3):
        seen = [reps[r][f"epochs_{drop_last}"][epoch] for r in range(world)]
        assert all(s["contents"] for s in seen)  # each batch equals numpy's windows
        assert len({tuple(s["sizes"]) for s in seen}) == 1  # the same batches on every rank
        firsts = [f for s in seen for f in s["firsts"]]
        assert set(firsts) <= set(every)
        if drop_last:
            assert len(firsts) == len(set(firsts))  # none twice
            per_rank = (n // world) // 3 * 3
            assert len(firsts) == per_rank * world
        else:
            assert set(firsts) == set(every)  # all, and only the padding twice
            per_rank = -(-n // world)
            assert len(firsts) == per_rank * world and len(firsts) - len(set(firsts)) == per_rank * world - n


@pytest.mark.parametrize("world", WORLDS)
def test_orders_change_with_the_epoch_and_repeat_for_the_same_seed(runs, world):
    for rank, rep in runs[world].items():
        orders = [e["firsts"] for e in rep["epochs_False"]]
        assert orders[0] != orders[1] != orders[2]
        assert rep["again_epoch1"] == orders[1]
    if world > 1:  # the ranks' shares differ
        assert runs[world][0]["epochs_False"][0]["firsts"] != runs[world][1]["epochs_False"][0]["firsts"]


@pytest.mark.parametrize("world", WORLDS)
def test_resume_mid_prefetch_gives_the_rest_in_order(runs, world):
    for rep in runs[world].values():
        r = rep["resume"]
        assert r["head"] + r["rest"] == r["whole"]
        assert r["epoch_after"] == 3  # the pass ended the epoch


@pytest.mark.parametrize("world", WORLDS)
def test_ledger_counts_the_bytes_delivered(runs, world):
    for rep in runs[world].values():
        delivered = sum(sum(e["sizes"]) for e in rep["epochs_False"]) * (SEQ_LEN + 1) * 4
        assert rep["stats_False"] == delivered


@pytest.mark.parametrize("world", WORLDS)
def test_a_state_of_another_world_size_is_refused(runs, world):
    for rep in runs[world].values():
        assert rep["other_world_refused"] == "StateDictMismatchError"


def test_window_identities_are_unique():
    assert FILE_STRIDE > max(TOKENS)
