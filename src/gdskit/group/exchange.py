"""The collectives of a group load, all through ``torch.distributed`` (no transport of our own).

- :func:`describe` says what a process group is: this rank, the world, which backend
  carries tensors of each device type (``"cpu:gloo,cuda:nccl"``, ``"nccl"``, ``"gloo"``),
  its timeout.
- :func:`all_gather_blobs` and :func:`failed_ranks` are the small control exchanges
  (on the host through gloo where the group has it, else on the current GPU).
- :func:`broadcast_window` sends one window's shared units from their owners, every
  broadcast issued at once (``async_op=True``) and waited on with a deadline.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gdskit.errors import InvalidArgumentError
from gdskit.group import failure

#: The process group's own timeout where torch does not say it (torch's default).
_DEFAULT_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """One process group as a load uses it."""

    group: Any            # torch.distributed ProcessGroup
    rank: int             # this process's rank in the group
    world: int
    backends: dict[str, str]  # device type ("cpu", "cuda") -> the backend that carries its tensors
    timeout_s: float      # how long one step may wait for the others

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank

    def control_device(self) -> torch.device:
        """Where the control exchanges' small tensors live."""
        if "cpu" in self.backends:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def comm_device(self, device_types: set[str]) -> torch.device:
        """The device whose memory every rank's broadcasts use, given the device types of all
        ranks' destinations: the GPU when every rank loads into GPU memory and the group has a
        backend for it, else host memory (ranks with GPU destinations copy from there)."""
        if device_types == {"cuda"} and "cuda" in self.backends:
            return torch.device("cuda", torch.cuda.current_device())
        if "cpu" in self.backends:
            return torch.device("cpu")
        raise InvalidArgumentError(
            f"the process group ({dist.get_backend(self.group)}) carries no host tensors, and the ranks load into "
            f"{', '.join(sorted(device_types))} memory; create it with a backend for both, e.g. "
            "init_process_group('cpu:gloo,cuda:nccl')")


def backend_map(text: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> {"cpu": "gloo", "cuda": "nccl"}; one name serves what it can."""
    text = str(text).lower()
    if ":" in text:
        out = {}
        for item in text.split(","):
            dev, _, name = item.partition(":")
            out[dev.strip()] = name.strip()
        return out
    if text == "nccl":
        return {"cuda": "nccl"}
    return {"cpu": text, "cuda": text}  # gloo (and mpi) carry host and GPU tensors


def describe(group: Any, timeout_s: float | None) -> GroupInfo:
    """What ``group`` is; :class:`InvalidArgumentError` if this process is not one of its ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError("process_group needs torch.distributed initialised (init_process_group)")
    if group is dist.group.WORLD or group is None:
        group = dist.group.WORLD
    try:
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        backends = backend_map(dist.get_backend(group))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"process_group is not a usable process group: {exc}") from None
    if rank < 0:
        raise InvalidArgumentError("this process is not a rank of process_group")
    return GroupInfo(group, rank, world, backends, timeout_s if timeout_s is not None else _group_timeout(group))


def _group_timeout(group: Any) -> float:
    for dev in ("cpu", "cuda"):
        try:
            td = group._get_backend(torch.device(dev)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(td, datetime.timedelta) and td.total_seconds() > 0:
            return td.total_seconds()
    return _DEFAULT_TIMEOUT_S


_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_blobs(info: GroupInfo, blob: bytes, deadline: failure.Deadline, what: str) -> list[bytes]:
    """Every rank's ``blob``, in rank order."""
    dev = info.control_device()
    with failure.collective(what):
        sizes = torch.empty(info.world, dtype=torch.int64, device=dev)
        failure.wait(_gather_single(sizes, torch.tensor([len(blob)], dtype=torch.int64, device=dev),
                                    group=info.group, async_op=True), deadline, what)
        counts = sizes.tolist()
        width = max(counts)
        if width == 0:
            return [b""] * info.world
        mine = torch.zeros(width, dtype=torch.uint8)
        if blob:
            mine[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        out = torch.empty(info.world * width, dtype=torch.uint8, device=dev)
        failure.wait(_gather_single(out, mine.to(dev), group=info.group, async_op=True), deadline, what)
        raw = out.cpu().numpy().tobytes()
    return [raw[r * width:r * width + counts[r]] for r in range(info.world)]


def failed_ranks(info: GroupInfo, failed: bool, deadline: failure.Deadline, what: str) -> tuple[int, ...]:
    """The ranks that say they failed (one all-reduce of a flag per rank)."""
    dev = info.control_device()
    with failure.collective(what):
        flags = torch.zeros(info.world, dtype=torch.int32, device=dev)
        if failed:
            flags[info.rank] = 1
        failure.wait(dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=info.group, async_op=True), deadline, what)
        got = flags.tolist()
    return tuple(r for r, v in enumerate(got) if v)


def broadcast_window(info: GroupInfo, items: Sequence[tuple[torch.Tensor, int]], deadline: failure.Deadline,
                     what: str) -> float:
    """Broadcast each ``(tensor, owner)`` from group rank ``owner`` (the same list, in the same
    order, on every rank); returns the seconds it took."""
    start = time.perf_counter()
    with failure.collective(what):
        works = [dist.broadcast(t, src=info.global_rank(owner), group=info.group, async_op=True)
                 for t, owner in items]
        for w in works:
            failure.wait(w, deadline, what)
    return time.perf_counter() - start
