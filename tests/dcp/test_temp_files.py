"""Temporary files are made afresh under names no one can guess and written through their own
descriptors: a symbolic link planted in the directory (before a write, or while one runs, at a
name seen or guessed) never redirects a write into another file."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gdskit import durable
from gdskit.errors import GdskitError

VICTIM_BYTES = b"the victim's own bytes\n" * 100


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    return victim


def _our_temps(directory: Path) -> list[str]:
    """Temporaries a writer left: regular files under a temporary's name (planted links are not ours)."""
    return sorted(e.name for e in os.scandir(directory)
                  if durable.is_temp_name(e.name) and e.is_file(follow_symlinks=False))


def test_a_new_file_is_never_made_through_a_planted_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    os.symlink(victim, tmp_path / "planted")
    with pytest.raises(FileExistsError):
        durable.create_new_file(str(tmp_path / "planted"))
    assert victim.read_bytes() == VICTIM_BYTES


def test_temporary_names_are_fresh_and_carry_no_pid(tmp_path: Path) -> None:
    owned = [durable.create_locked_temp(tmp_path, "x.bin") for _ in range(20)]
    fd_and_paths = [durable.create_temp_file(tmp_path, ".probe-") for _ in range(20)]
    try:
        names = [os.path.basename(o.path) for o in owned] + [os.path.basename(p) for _fd, p in fd_and_paths]
        assert len(set(names)) == len(names)
        assert not any(str(os.getpid()) in n.split(".") for n in names)
    finally:
        for o in owned:
            o.discard()
        for fd, path in fd_and_paths:
            os.close(fd)
            os.unlink(path)


def test_write_whole_writes_its_own_file_when_its_name_is_swapped(tmp_path: Path) -> None:
    """``fill`` is handed a path to the temporary itself: swapping the name for a link to the
    victim mid-write changes nothing of the victim, and the swap is an error, not a publish."""
    victim = _victim(tmp_path)
    out = tmp_path / "report.txt"

    def fill(tmp: str) -> None:
        (name,) = [e for e in os.listdir(tmp_path) if durable.is_temp_name(e)]
        os.unlink(tmp_path / name)
        os.symlink(victim, tmp_path / name)  # another user swaps the temporary for a link
        with open(tmp, "w") as fh:
            fh.write("report")

    with pytest.raises(GdskitError):
        durable.write_whole(out, fill)
    assert victim.read_bytes() == VICTIM_BYTES
    assert not out.exists() and _our_temps(tmp_path) == []


# -- DCP ------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
import gdskit.dcp  # noqa: E402

_FIXED_SAVE_ID = "0badc0de-0000-4000-8000-000000000000"


class _KnownIdWriter(gdskit.dcp.StorageWriter):
    """A writer whose save id is known in advance, as a reader of the directory learns it."""

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self.save_id = _FIXED_SAVE_ID


def _state(mib: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(mib << 18, generator=g), "b": torch.arange(7), "step": 3}


def _save(sd: dict[str, Any], writer: Any) -> BaseException | None:
    try:
        dcp.save(sd, storage_writer=writer, no_dist=True)
    except dcp.api.CheckpointException as exc:  # DCP wraps a rank's failure in it (a BaseException)
        return exc
    return None


def _rank_errors(exc: BaseException) -> list[BaseException]:
    fails = getattr(exc, "failures", None) or getattr(exc, "_failures", None) or {}
    return [e[0] if isinstance(e, tuple) else e for e in fails.values()] or [exc]


def _assert_loads(directory: Path, sd: dict[str, Any]) -> None:
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    dcp.load(got, storage_reader=gdskit.dcp.StorageReader(directory), no_dist=True)
    for k, v in sd.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v


@pytest.mark.filterwarnings("ignore")
def test_links_planted_at_the_names_a_save_id_predicts_are_never_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    token = _FIXED_SAVE_ID[:8]
    for name in ("__0_0.distcp", ".metadata"):
        os.symlink(victim, ckpt / durable.temp_name(name, token))
    sd = _state()
    assert _save(sd, _KnownIdWriter(ckpt)) is None
    assert victim.read_bytes() == VICTIM_BYTES
    assert _our_temps(ckpt) == []
    _assert_loads(ckpt, sd)


class _Planter:
    """A thread that watches a checkpoint directory while a save runs and, for every temporary
    it sees, plants links to the victim at the names the temporary's token would give the
    other files, and swaps the temporary itself for such a link."""

    def __init__(self, directory: Path, victim: Path, swap: bool) -> None:
        self.directory, self.victim, self.swap = directory, victim, swap
        self.stop = threading.Event()
        self.seen: set[str] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _plant(self, name: str) -> None:
        try:
            os.symlink(self.victim, self.directory / name)
        except OSError:
            pass

    def _run(self) -> None:
        while not self.stop.is_set():
            for entry in os.listdir(self.directory):
                if not durable.is_temp_name(entry) or entry in self.seen:
                    continue
                self.seen.add(entry)
                token = entry[:-len(durable.TEMP_SUFFIX)].rsplit(".", 1)[-1]
                for other in ("__0_0.distcp", ".metadata"):
                    self._plant(durable.temp_name(other, token))
                if self.swap and not os.path.islink(self.directory / entry):
                    try:
                        os.unlink(self.directory / entry)
                    except OSError:
                        continue
                    self._plant(entry)

    def __enter__(self) -> _Planter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("swap", [False, True], ids=["guessed names", "guessed names and swapped temporaries"])
def test_a_directory_watched_during_saves_never_redirects_a_write(tmp_path: Path, swap: bool) -> None:
    victim = _victim(tmp_path)
    sd = _state(8)
    for attempt in range(4):
        ckpt = tmp_path / f"c{attempt}"
        ckpt.mkdir()
        with _Planter(ckpt, victim, swap):
            failed = _save(sd, gdskit.dcp.StorageWriter(ckpt))
        assert victim.read_bytes() == VICTIM_BYTES
        assert _our_temps(ckpt) == []
        if failed is None:
            _assert_loads(ckpt, sd)
        else:
            assert all(isinstance(e, GdskitError) for e in _rank_errors(failed)), failed

