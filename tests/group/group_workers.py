"""Ranks of the fan-out tests: ``python group_workers.py WORLD_NAME RANK WORLD WORKDIR``.

Each rank joins a process group (gloo; for the GPU worlds gloo with GPU tensors, or
NCCL for them where every rank has its own GPU), runs the world's scenarios in order and, after
each, rewrites ``WORKDIR/WORLD_NAME.RANK.json``: ``{scenario: facts}``, where facts hold
what the rank saw (tensors equal to the reference library's, ledger figures, the class
chain of what it raised). The tests assert on the facts of every rank. The fixture
checkpoints and ``manifest.json`` are made by the test before the launch. Kept outside
``test_*`` so pytest does not collect it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

import gdskit
import gdskit.group
import gdskit.safetensors
import gdskit.torch

warnings.filterwarnings("ignore")

#: Small windows and pieces, so that a checkpoint of a few MiB takes many windows, split tensors,
#: small-tensor units and every kind of unit.
WINDOW = "192KiB"
PIECE = "64KiB"


class Stop(Exception):
    """Raised by a progress callback on purpose."""


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str:
    """'' when ``got`` holds exactly ``want``'s tensors, else what differs."""
    if sorted(got) != sorted(want):
        return f"names differ: {sorted(set(got) ^ set(want))[:5]}"
    bad = [k for k in want if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
           or not torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.bool else got[k],
                              want[k].view(torch.uint8) if want[k].dtype == torch.bool else want[k])]
    return f"tensors differ: {bad[:5]}" if bad else ""


def ledger_facts(stats: gdskit.Stats) -> dict[str, Any]:
    return {"storage": stats.storage_bytes, "peer": stats.peer_bytes,
            "peer_path": stats.paths.get("peer", gdskit.PathStats()).bytes_read,
            "sources": {f"{p.source_rank}/{p.backend}": p.bytes for p in stats.peers},
            "paths": sorted(stats.paths)}


def raised(exc: BaseException) -> dict[str, Any]:
    path = getattr(exc, "path", None)
    return {"raised": [c.__name__ for c in type(exc).__mro__], "ranks": list(getattr(exc, "ranks", ())),
            "path": None if path is None else os.path.basename(path), "message": str(exc)[:500],
            **{k: getattr(exc, k) for k in ("tensor", "expected", "actual") if hasattr(exc, k)}}


class Rank:
    def __init__(self, name: str, rank: int, world: int, workdir: str, device: str = "cpu") -> None:
        self.name, self.rank, self.world, self.workdir = name, rank, world, workdir
        self.device = device
        with open(os.path.join(workdir, "manifest.json")) as fh:
            self.manifest = json.load(fh)
        self.results: dict[str, Any] = {}
        self.pg = dist.group.WORLD

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def save(self) -> None:
        out = os.path.join(self.workdir, f"{self.name}.{self.rank}.json")
        with open(out + ".tmp", "w") as fh:
            json.dump(self.results, fh)
        os.replace(out + ".tmp", out)

    def check(self, scenario: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            facts = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            facts = {"unexpected": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        self.results[scenario] = facts
        self.save()
        print(f"[rank {self.rank}] {scenario}: {str(facts)[:300]}", file=sys.stderr, flush=True)

    def expect_failure(self, fn: Callable[[], Any]) -> dict[str, Any]:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return raised(exc)
        return {"raised": []}

    # -- loads that succeed ---------------------------------------------------------------------
    def load_st(self, path: str, keys: list[str] | None = None) -> dict[str, Any]:
        with gdskit.group.options(window=WINDOW, piece=PIECE):
            got, stats = gdskit.safetensors.load_file(path, self.device, process_group=self.pg, keys=keys,
                                                      return_stats=True)
        if any(t.device.type != torch.device(self.device).type for t in got.values()):
            return {"differs": "a tensor is not on the device asked for"}
        got = {k: v.cpu() for k, v in got.items()}
        want = self.reference(path)
        if keys is not None:
            want = {k: want[k] for k in keys}
        return {"differs": same(got, want), **ledger_facts(stats)}

    def reference(self, path: str) -> dict[str, torch.Tensor]:
        """What the safetensors library loads (an index file: every file of its directory)."""
        if path.endswith(".json") or os.path.isdir(path):
            folder = os.path.dirname(path) if path.endswith(".json") else path
            out: dict[str, torch.Tensor] = {}
            for name in sorted(os.listdir(folder)):
                if name.endswith(".safetensors"):
                    out.update(safetensors.torch.load_file(os.path.join(folder, name)))
            return out
        return safetensors.torch.load_file(path)

    def replicated(self) -> dict[str, Any]:
        return self.load_st(self.path("replicated.safetensors"))

    def sharded(self) -> dict[str, Any]:
        return self.load_st(self.path("sharded/model.safetensors.index.json"))

    def keys(self) -> dict[str, Any]:
        """Each rank its own tensors (every world-th one) plus the shared ones."""
        names = self.manifest["replicated_names"]
        mine = [n for i, n in enumerate(names) if n.startswith("shared") or i % self.world == self.rank]
        return self.load_st(self.path("replicated.safetensors"), keys=mine)

    def torch_load(self, name: str = "ckpt.pt") -> dict[str, Any]:
        path = self.path(name)
        with gdskit.group.options(window=WINDOW, piece=PIECE):
            got, stats = gdskit.torch.load(path, map_location=self.device, process_group=self.pg, return_stats=True)
        views_shared = got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
        got = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}
        want = torch.load(path, map_location="cpu", weights_only=True)
        differs = same({k: v for k, v in got.items() if isinstance(v, torch.Tensor)},
                       {k: v for k, v in want.items() if isinstance(v, torch.Tensor)})
        return {"differs": differs, "step": got["step"], "views_shared": views_shared, **ledger_facts(stats)}

    def copy_on_rank_one(self) -> dict[str, Any]:
        """Rank 1 loads a byte copy of rank 0's file (another path, another mtime)."""
        return self.load_st(self.path("copy/replicated.safetensors" if self.rank == 1 else "replicated.safetensors"))

    def torch_copy_on_rank_one(self) -> dict[str, Any]:
        return self.torch_load("copy/ckpt.pt" if self.rank == 1 else "ckpt.pt")

    def torch_deflated(self) -> dict[str, Any]:
        """An archive with deflated storage records (and one stored): torch.load's values."""
        return self.torch_load("deflated.pt")

    # -- loads of objects (tests/group/test_group_objects.py) ----------------------------------
    def load_object(self, url: str, local: str) -> dict[str, Any]:
        """``url`` loaded by the group; the reference is safetensors' own load of ``local``, its copy."""
        with gdskit.group.options(window=WINDOW, piece=PIECE):
            got, stats = gdskit.safetensors.load_file(url, self.device, process_group=self.pg, return_stats=True)
        obj = stats.paths.get("object", gdskit.PathStats())
        return {"differs": same({k: v.cpu() for k, v in got.items()}, self.reference(self.path(local))),
                "object": obj.bytes_read, **ledger_facts(stats)}

    def object_replicated(self) -> dict[str, Any]:
        return self.load_object(self.manifest["objects"]["replicated"], "replicated.safetensors")

    def object_sharded(self) -> dict[str, Any]:
        return self.load_object(self.manifest["objects"]["sharded"], "sharded")

    def object_torch(self) -> dict[str, Any]:
        url = self.manifest["objects"]["torch"]
        with gdskit.group.options(window=WINDOW, piece=PIECE):
            got, stats = gdskit.torch.load(url, map_location=self.device, process_group=self.pg, return_stats=True)
        want = torch.load(self.path("ckpt.pt"), map_location="cpu", weights_only=True)
        differs = same({k: v.cpu() for k, v in got.items() if isinstance(v, torch.Tensor)},
                       {k: v for k, v in want.items() if isinstance(v, torch.Tensor)})
        obj = stats.paths.get("object", gdskit.PathStats())
        return {"differs": differs, "step": got["step"], "object": obj.bytes_read, **ledger_facts(stats)}

    def object_other_values_on_rank_one(self) -> dict[str, Any]:
        """Rank 1 loads an object of the same layout and other values: refused on every rank."""
        key = "other" if self.rank == 1 else "replicated"
        return self.expect_failure(lambda: gdskit.safetensors.load_file(
            self.manifest["objects"][key], self.device, process_group=self.pg))

    # -- verify= (tests/group/test_group_verify.py) ----------------------------------------------
    def load_verified(self, name: str, keys: list[str] | None = None) -> dict[str, Any]:
        """A group load with verify=True; its tensors against the plain group load's and safetensors'."""
        path = self.path(name)
        with gdskit.group.options(window=WINDOW, piece=PIECE, timeout=30):
            got, stats = gdskit.safetensors.load_file(path, self.device, process_group=self.pg, keys=keys,
                                                      return_stats=True, verify=True)
            plain = gdskit.safetensors.load_file(path, self.device, process_group=self.pg, keys=keys)
        want = self.reference(path)
        if keys is not None:
            want = {k: want[k] for k in keys}
        held = sum(t.numel() * t.element_size() for t in got.values())
        return {"differs": same({k: v.cpu() for k, v in got.items()}, want),
                "differs_from_plain": same({k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in plain.items()}),
                "held": held, "verified": stats.verified.bytes, **ledger_facts(stats)}

    def verified(self) -> dict[str, Any]:
        return self.load_verified("digested.safetensors")

    def verified_keys(self) -> dict[str, Any]:
        names = self.manifest["digested_names"]
        return self.load_verified("digested.safetensors", keys=[n for i, n in enumerate(names) if i % self.world == self.rank])

    def verified_sharded(self) -> dict[str, Any]:
        """A sharded checkpoint checked against the manifest in its directory."""
        return self.load_verified("digested_sharded/model.safetensors.index.json")

    def flipped(self) -> dict[str, Any]:
        """Every rank loads a file with one byte flipped in the data of a tensor every rank wants."""
        return self.expect_failure(lambda: self.load_verified("flipped.safetensors"))

    def flipped_where_only_rank_zero_looks(self) -> dict[str, Any]:
        """The flipped byte lies in a tensor only rank 0 loads: the other ranks raise all the same."""
        flipped = self.manifest["flipped_tensor"]
        names = self.manifest["digested_names"]
        keys = names if self.rank == 0 else [n for n in names if n != flipped]
        return self.expect_failure(lambda: self.load_verified("flipped.safetensors", keys=keys))

    def torch_verified(self) -> dict[str, Any]:
        """gdskit.torch.load with verify=True against the manifest in the archive's directory."""
        path = self.path("torch_digested/ckpt.pt")
        with gdskit.group.options(window=WINDOW, piece=PIECE, timeout=30):
            got, stats = gdskit.torch.load(path, map_location=self.device, process_group=self.pg, return_stats=True,
                                           verify=True)
        want = torch.load(path, map_location="cpu", weights_only=True)
        differs = same({k: v.cpu() for k, v in got.items() if isinstance(v, torch.Tensor)},
                       {k: v for k, v in want.items() if isinstance(v, torch.Tensor)})
        return {"differs": differs, "step": got["step"], "verified": stats.verified.bytes, **ledger_facts(stats)}

    def torch_flipped(self) -> dict[str, Any]:
        def load() -> None:
            with gdskit.group.options(window=WINDOW, piece=PIECE, timeout=30):
                gdskit.torch.load(self.path("torch_flipped/ckpt.pt"), map_location=self.device, process_group=self.pg,
                                  verify=True)
        return self.expect_failure(load)

    def nothing_to_verify(self) -> dict[str, Any]:
        return self.expect_failure(lambda: self.load_verified("replicated.safetensors"))

    def verify_on_rank_zero_only(self) -> dict[str, Any]:
        """Ranks that do not all verify are refused before anything is read (they would not meet at the check)."""
        def load() -> None:
            with gdskit.group.options(window=WINDOW, piece=PIECE, timeout=30):
                gdskit.safetensors.load_file(self.path("digested.safetensors"), self.device, process_group=self.pg,
                                             verify=self.rank == 0)
        return self.expect_failure(load)

    # -- loads that fail ------------------------------------------------------------------------
    def bad_file_on_last_rank(self) -> dict[str, Any]:
        name = "garbage.safetensors" if self.rank == self.world - 1 else "replicated.safetensors"
        return self.expect_failure(lambda: self.load_st(self.path(name)))

    def torch_damaged(self) -> dict[str, Any]:
        """Every rank loads an archive whose byteorder record is not text."""
        return self.expect_failure(lambda: self.torch_load("damaged.pt"))

    def missing_key_on_rank_zero(self) -> dict[str, Any]:
        keys = ["no-such-tensor"] if self.rank == 0 else None
        return self.expect_failure(lambda: self.load_st(self.path("replicated.safetensors"), keys=keys))

    def other_checkpoint_on_rank_one(self) -> dict[str, Any]:
        name = "sharded" if self.rank == 1 else "replicated.safetensors"
        return self.expect_failure(lambda: self.load_st(self.path(name)))

    def other_values_on_rank_one(self) -> dict[str, Any]:
        """Rank 1's file has the same layout as rank 0's, other values."""
        name = "other/replicated.safetensors" if self.rank == 1 else "replicated.safetensors"
        return self.expect_failure(lambda: self.load_st(self.path(name)))

    def other_torch_values_on_rank_one(self) -> dict[str, Any]:
        name = "other/ckpt.pt" if self.rank == 1 else "ckpt.pt"
        return self.expect_failure(lambda: self.torch_load(name))

    def other_torch_values_loaded_alone(self) -> dict[str, Any]:
        """A callable map_location: every rank loads its own file, and the group still refuses."""
        name = "other/ckpt.pt" if self.rank == 1 else "ckpt.pt"

        def load() -> None:
            gdskit.torch.load(self.path(name), map_location=lambda storage, location: storage, process_group=self.pg)
        return self.expect_failure(load)

    def callback_raises_on_last_rank(self) -> dict[str, Any]:
        def stop(done: int, total: int) -> None:
            if self.rank == self.world - 1:
                raise Stop("stopped by the test")

        def load() -> None:
            with gdskit.group.options(window=WINDOW, piece=PIECE):
                gdskit.safetensors.load_file(self.path("replicated.safetensors"), "cpu", process_group=self.pg,
                                             progress=stop)
        return self.expect_failure(load)

    def killed_last_rank(self) -> dict[str, Any]:
        """The last rank dies after its first window; the others must raise, not hang."""
        def die(done: int, total: int) -> None:
            if self.rank == self.world - 1:
                self.results["killed_last_rank"] = {"died": True}
                self.save()
                os._exit(17)

        def load() -> None:
            with gdskit.group.options(window=WINDOW, piece=PIECE, timeout=30):
                gdskit.safetensors.load_file(self.path("replicated.safetensors"), "cpu", process_group=self.pg,
                                             progress=die)
        return self.expect_failure(load)

    def stalled_last_rank(self) -> dict[str, Any]:
        """The last rank stops answering for longer than the timeout; the others raise when it passes."""
        timeout = 2.0

        def stall(done: int, total: int) -> None:
            if self.rank == self.world - 1 and done < total:
                time.sleep(2 * timeout)

        def load() -> None:
            with gdskit.group.options(window=WINDOW, piece=PIECE, timeout=timeout):
                gdskit.safetensors.load_file(self.path("replicated.safetensors"), "cpu", process_group=self.pg,
                                             progress=stall)
        return self.expect_failure(load)


WORLDS: dict[str, list[str]] = {
    # A world ends with the scenario that breaks its process group.
    "two": ["replicated", "sharded", "keys", "torch_load", "bad_file_on_last_rank", "missing_key_on_rank_zero",
            "other_checkpoint_on_rank_one", "other_values_on_rank_one", "other_torch_values_on_rank_one",
            "other_torch_values_loaded_alone", "copy_on_rank_one", "torch_copy_on_rank_one",
            "torch_deflated", "torch_damaged", "callback_raises_on_last_rank", "replicated_after_failures", "stalled_last_rank"],
    "four": ["replicated", "sharded", "keys", "torch_load", "bad_file_on_last_rank",
             "callback_raises_on_last_rank", "replicated_after_failures", "killed_last_rank"],
    "one": ["replicated", "keys", "torch_load"],
    # s3:// objects of moto's server (tests/group/test_group_objects.py).
    "objects": ["object_replicated", "object_sharded", "object_torch", "object_other_values_on_rank_one"],
    "verify": ["verified", "verified_keys", "verified_sharded", "flipped", "flipped_where_only_rank_zero_looks",
               "torch_verified", "torch_flipped", "nothing_to_verify", "verify_on_rank_zero_only",
               "verified_after_failures"],
    # GPU memory, every rank on the GPU its rank picks (tests/group/test_group_gpu.py).
    "gpu": ["replicated", "sharded", "keys", "torch_load", "bad_file_on_last_rank", "replicated_after_failures"],
}


def main() -> None:
    name, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    backend = sys.argv[5] if len(sys.argv) > 5 else "gloo"  # "gloo", or "cpu:gloo,cuda:nccl"
    device = "cpu"
    if name == "gpu":
        gpu = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        device = str(gpu)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'store.' + name)}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    r = Rank(name, rank, world, workdir, device)
    for scenario in WORLDS[name]:
        fn = getattr(r, scenario.replace("_after_failures", ""))
        r.check(scenario, fn)
    sys.stdout.flush()
    sys.stderr.flush()
    if name == "gpu":
        torch.cuda.synchronize()
    os._exit(0)  # the last scenario may have left the group broken: no barrier, no destroy


if __name__ == "__main__":
    main()
