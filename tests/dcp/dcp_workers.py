"""Ranks of the multi-process DCP tests: ``python dcp_workers.py PHASE RANK WORLD WORKDIR DEVICE``.

Each rank joins a process group (gloo on CPU; gloo for CPU plus NCCL for CUDA
when there are several GPUs), runs the phase's checks in order and writes
``WORKDIR/PHASE.RANK.json``: ``{check: {"ok": bool, "detail": str}}``. Every
check compares real tensors with the values they must hold; the tests assert on
the outcome. Kept outside ``test_*`` so pytest does not collect it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import gdskit
import gdskit.dcp

warnings.filterwarnings("ignore")


class InjectedFailure(RuntimeError):
    """Raised on purpose by :class:`FailingPlanner`."""


class FailingPlanner(DefaultSavePlanner):
    """Fails on ``fail_rank`` when the writer asks for the large ``big`` shard (after smaller items went out)."""

    def __init__(self, fail_rank: int) -> None:
        super().__init__()
        self.fail_rank = fail_rank

    def resolve_data(self, write_item: Any) -> Any:
        if (dist.get_rank() == self.fail_rank and write_item.type != WriteItemType.BYTE_IO
                and write_item.index.fqn == "big"):
            raise InjectedFailure("injected failure while writing")
        return super().resolve_data(write_item)


class Rank:
    def __init__(self, rank: int, world: int, workdir: str, device: str) -> None:
        self.rank, self.world, self.workdir = rank, world, workdir
        if device == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.mesh = init_device_mesh(self.device.type, (world,))
        self.results: dict[str, dict[str, Any]] = {}

    # -- the data every phase saves and expects -------------------------------
    @staticmethod
    def full() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1234)
        return {
            "big": torch.randn(1024, 1024, generator=g),                      # >= 1 MiB per shard: aligned path
            "bias": torch.randn(96, generator=g),
            "half": torch.randn(64, 40, generator=g).to(torch.bfloat16),
            "cols": torch.randn(32, 48, generator=g),                          # sharded on dim 1
            "rep": torch.arange(300, dtype=torch.int64),                       # plain tensor, same on every rank
            "window": torch.arange(1000, dtype=torch.float64)[100:400],        # a view into a larger storage
        }

    SHARD_DIM = {"big": 0, "bias": 0, "half": 0, "cols": 1}

    def state_dict(self, zeros: bool = False, local: bool = True) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for name, t in self.full().items():
            if zeros:
                t = torch.zeros_like(t)
            if name in self.SHARD_DIM:
                # clone: DTensors over views of a larger storage break torch's own async staging (deepcopy)
                chunk = t.chunk(self.world, self.SHARD_DIM[name])[self.rank].clone().to(self.device)
                sd[name] = DTensor.from_local(chunk, self.mesh, [Shard(self.SHARD_DIM[name])], run_check=False)
            else:
                sd[name] = t.to(self.device)
        sd["extra"] = {"step": 0 if zeros else 7, "note": "" if zeros else "gdskit"}
        if local:
            v = torch.full((5,), float(self.rank)) if not zeros else torch.zeros(5)
            sd[f"local.r{self.rank}"] = v.to(self.device)
        return sd

    def compare(self, got: dict[str, Any], local: bool = True) -> str:
        """'' if ``got`` holds this rank's expected values, else what differs."""
        want = self.state_dict(local=local)
        bad = []
        for k, w in want.items():
            g = got[k]
            if isinstance(w, DTensor):
                w, g = w.to_local(), g.to_local()
            if isinstance(w, torch.Tensor):
                if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g.cpu(), w.cpu()):
                    bad.append(k)
            elif g != w:
                bad.append(k)
        return ", ".join(bad)

    # -- helpers --------------------------------------------------------------
    def path(self, name: str) -> str:
        return os.path.join(self.workdir, "ckpt", name)

    def check(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            out = fn()
            ok = out is None or out == "" or out is True
            self.results[name] = {"ok": ok, "detail": "" if ok else str(out)}
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            self.results[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        print(f"[rank {self.rank}] {name}: {self.results[name]}", file=sys.stderr, flush=True)

    def load_and_compare(self, reader: Any, local: bool = True) -> str:
        sd = self.state_dict(zeros=True, local=local)
        dcp.load(sd, storage_reader=reader)
        return self.compare(sd, local=local)

    def save(self, writer: Any) -> None:
        dcp.save(self.state_dict(), storage_writer=writer)

    def stock_writer(self, name: str) -> FileSystemWriter:
        return FileSystemWriter(self.path(name), sync_files=True, thread_count=2)

    # -- phases ---------------------------------------------------------------
    def phase_first(self) -> None:
        """World 2: save and load both ways, async save, a failing rank."""
        self.check("save_gdskit", lambda: self.save(gdskit.dcp.StorageWriter(self.path("g2"))))
        self.check("load_gdskit", lambda: self.load_and_compare(gdskit.dcp.StorageReader(self.path("g2"))))
        self.check("gdskit_to_stock", lambda: self.load_and_compare(FileSystemReader(self.path("g2"))))
        self.check("save_digests", lambda: self.save(gdskit.dcp.StorageWriter(self.path("d2"), digests=True)))
        self.check("load_verified", lambda: self.load_and_compare(gdskit.dcp.StorageReader(self.path("d2"),
                                                                                             verify=True)))
        self.check("save_stock", lambda: self.save(self.stock_writer("s2")))
        self.check("stock_to_gdskit", lambda: self.load_and_compare(gdskit.dcp.StorageReader(self.path("s2"))))

        def async_save() -> str:
            fut = dcp.async_save(self.state_dict(), storage_writer=gdskit.dcp.StorageWriter(self.path("a2")))
            (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
            return self.load_and_compare(gdskit.dcp.StorageReader(self.path("a2")))
        self.check("async_save", async_save)
        self.failing_rank()

    def failing_rank(self) -> None:
        outcome: dict[str, Any] = {}

        def save() -> str:
            try:
                dcp.save(self.state_dict(), storage_writer=gdskit.dcp.StorageWriter(self.path("f2")),
                         planner=FailingPlanner(fail_rank=self.world - 1))
            except BaseException as exc:  # noqa: BLE001
                failures = getattr(exc, "failures", None) or getattr(exc, "_failures", {}) or {}
                outcome["type"] = type(exc).__name__
                outcome["injected"] = any(isinstance(e[0] if isinstance(e, tuple) else e, InjectedFailure)
                                          for e in failures.values())
                return ""
            return "the save did not fail"
        self.check("fail_raises", save)
        self.check("fail_raises_checkpoint_exception", lambda: outcome.get("type") == "CheckpointException"
                   and outcome.get("injected") or f"got {outcome}")
        dist.barrier()

        def leftovers() -> str:
            names = sorted(os.listdir(self.path("f2")))
            bad = [n for n in names if n == ".metadata" or n.startswith(".") or n == f"__{self.world - 1}_0.distcp"]
            return f"left behind: {bad} (all: {names})" if bad else ""
        self.check("fail_nothing_visible", leftovers)

        def refused() -> str:
            try:
                gdskit.dcp.StorageReader(self.path("f2")).read_metadata()
            except gdskit.dcp.IncompleteCheckpointError:
                return ""
            return "read_metadata accepted an incomplete checkpoint"
        self.check("fail_reader_refuses", refused)

        def stock_refuses() -> str:
            try:
                self.load_and_compare(FileSystemReader(self.path("f2")))
            except BaseException:  # noqa: BLE001
                return ""
            return "the stock reader loaded an incomplete checkpoint"
        self.check("fail_stock_refuses", stock_refuses)
        self.check("fail_previous_intact", lambda: self.load_and_compare(gdskit.dcp.StorageReader(self.path("g2"))))

    def phase_wide(self) -> None:
        """World 4: load the 2-rank checkpoints (2 -> 4), save 4-rank ones."""
        self.check("reshard_2_4_gdskit", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("g2")), local=False))
        self.check("reshard_2_4_stock_written", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("s2")), local=False))
        self.check("reshard_2_4_verified", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("d2"), verify=True), local=False))
        self.check("save_gdskit_4", lambda: self.save(gdskit.dcp.StorageWriter(self.path("g4"))))
        self.check("save_digests_4", lambda: self.save(gdskit.dcp.StorageWriter(self.path("d4"), digests=True)))
        self.check("save_stock_4", lambda: self.save(self.stock_writer("s4")))

    def phase_narrow(self) -> None:
        """World 2 again: load the 4-rank checkpoints (4 -> 2)."""
        self.check("reshard_4_2_gdskit", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("g4")), local=False))
        self.check("reshard_4_2_verified", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("d4"), verify=True), local=False))
        self.check("reshard_4_2_gdskit_to_stock", lambda: self.load_and_compare(
            FileSystemReader(self.path("g4")), local=False))
        self.check("reshard_4_2_stock_to_gdskit", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("s4")), local=False))

    def phase_gpu(self) -> None:
        """Tensors on this rank's GPU: save and load through gdskit, the ledger names the path."""
        payload = sum(t.numel() * t.element_size() for t in self.full().values()) // self.world
        before = gdskit.stats()
        self.check("gpu_save", lambda: self.save(gdskit.dcp.StorageWriter(self.path("gpu"))))
        mid = gdskit.stats()
        self.check("gpu_load", lambda: self.load_and_compare(gdskit.dcp.StorageReader(self.path("gpu"))))
        after = gdskit.stats()
        self.check("gpu_gdskit_to_stock", lambda: self.load_and_compare(FileSystemReader(self.path("gpu"))))
        self.check("gpu_save_stock", lambda: self.save(self.stock_writer("gpu_stock")))
        self.check("gpu_stock_to_gdskit", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("gpu_stock"))))

        def async_save() -> str:
            fut = dcp.async_save(self.state_dict(), storage_writer=gdskit.dcp.StorageWriter(self.path("gpu_async")))
            (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
            return self.load_and_compare(gdskit.dcp.StorageReader(self.path("gpu_async")))
        self.check("gpu_async_save", async_save)
        wrote = gdskit.stats_delta(before, mid)
        read = gdskit.stats_delta(mid, after)
        dev_written = sum(p.bytes_written for name, p in wrote.paths.items() if name != "host")
        dev_read = sum(p.bytes_read for name, p in read.paths.items() if name != "host")
        self.results["gpu_ledger"] = {
            "ok": dev_written >= payload // 2 and dev_read >= payload // 2,
            "detail": json.dumps({"save": wrote.to_dict()["paths"], "load": read.to_dict()["paths"],
                                  "payload": payload}),
        }


    def phase_gpu_one(self) -> None:
        """One rank, after ``gpu`` ran on every GPU: its checkpoints resharded onto this rank's GPU."""
        self.check("gpu_reshard_one_rank", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("gpu")), local=False))
        self.check("gpu_stock_reshard_one_rank", lambda: self.load_and_compare(
            gdskit.dcp.StorageReader(self.path("gpu_stock")), local=False))


def main() -> None:
    phase, rank, world, workdir, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    if device == "cuda" and world > 1:
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    store = os.path.join(workdir, f"store.{phase}")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    r = Rank(rank, world, workdir, device)
    try:
        getattr(r, f"phase_{phase}")()
    finally:
        with open(os.path.join(workdir, f"{phase}.{rank}.json"), "w") as fh:
            json.dump(r.results, fh)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
