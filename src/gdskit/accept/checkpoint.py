"""Item 6: files gdskit writes are ordinary checkpoints, and every reader gets the same bytes back.

gdskit writes a safetensors file and a torch.save file; each is read back by
the plain libraries (``safetensors.torch.load_file``, ``torch.load``), by gdskit
on its normal path (``auto``) and by gdskit forced onto the fallback path
(``bounce`` for GPU memory, ``host`` without a GPU). Every tensor must come
back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import gdskit
from gdskit.accept.result import FAIL, NA, PASS
from gdskit.accept.workload import make_tensors, same_bytes


def _compare(torch: Any, want: dict[str, Any], got: Any) -> str | None:
    """None when identical, else what differs."""
    if not isinstance(got, dict):
        return f"loaded a {type(got).__name__}, not a dict"
    if set(got) != set(want):
        return f"names differ: missing {sorted(set(want) - set(got))[:3]}, extra {sorted(set(got) - set(want))[:3]}"
    bad = [k for k in want if not same_bytes(torch, want[k], got[k])]
    return f"{len(bad)} tensor(s) differ, e.g. {bad[0]}" if bad else None


def _ledger_paths(delta: Any) -> str:
    parts = [f"{p} {ps.bytes_read >> 10} KiB" for p, ps in sorted(delta.paths.items()) if ps.bytes_read]
    return ", ".join(parts) or "no bytes read through gdskit"


def _attempt(torch: Any, want: dict[str, Any], name: str, load: Callable[[], Any],
             allowed_paths: set[str] | None = None) -> dict[str, Any]:
    before = gdskit.stats()
    try:
        got = load()
    except Exception as exc:  # any reader failing is the finding
        return {"check": name, "status": FAIL, "detail": f"raised {type(exc).__name__}: {exc}"}
    delta = gdskit.stats() - before
    problem = _compare(torch, want, got)
    row = {"check": name, "ledger": delta.to_dict()}
    if problem:
        return {**row, "status": FAIL, "detail": problem}
    taken = {p for p, ps in delta.paths.items() if ps.bytes_read}
    if allowed_paths is not None and not taken <= allowed_paths:
        return {**row, "status": FAIL,
                "detail": f"identical, but read through {', '.join(sorted(taken - allowed_paths))}, not the fallback path"}
    via = f" (gdskit ledger: {_ledger_paths(delta)})" if delta.entries else ""
    return {**row, "status": PASS, "detail": f"{len(want)} tensors identical{via}"}


def round_trip(directory: str, nbytes: int, device: str) -> dict[str, Any]:
    """Write both formats with gdskit under ``directory`` and read them back every way."""
    import torch  # noqa: PLC0415 - optional dependency (torch)

    import gdskit.safetensors as gst  # noqa: PLC0415 - import time
    import gdskit.torch as gtorch  # noqa: PLC0415 - import time

    want = make_tensors(torch, nbytes, device, tensor_bytes=max(4096, nbytes // 16))
    total = sum(t.numel() * t.element_size() for t in want.values())
    st_path = os.path.join(directory, "model.safetensors")
    pt_path = os.path.join(directory, "model.pt")
    rows: list[dict[str, Any]] = []
    try:
        gst.save_file(want, st_path, metadata={"format": "pt"})
        gtorch.save(want, pt_path)
    except Exception as exc:
        rows.append({"check": "gdskit writes both formats", "status": FAIL, "detail": f"{type(exc).__name__}: {exc}"})
        return {"bytes": total, "device": device, "checks": rows}
    rows.append({"check": "gdskit writes both formats", "status": PASS,
                 "detail": f"{os.path.getsize(st_path)} B safetensors, {os.path.getsize(pt_path)} B torch.save"})

    try:
        from safetensors.torch import load_file as st_load  # noqa: PLC0415 - optional dependency (safetensors)
    except ImportError:
        rows.append({"check": "safetensors library reads gdskit's safetensors file", "status": NA,
                     "detail": "the safetensors library is not installed (pip install 'gdskit[torch]')"})
    else:
        rows.append(_attempt(torch, want, "safetensors library reads gdskit's safetensors file",
                             lambda: st_load(st_path, device=device)))
    rows.append(_attempt(torch, want, "plain torch.load reads gdskit's torch.save file",
                         lambda: torch.load(pt_path, map_location=device, weights_only=True)))

    rows.append(_attempt(torch, want, "gdskit loads the safetensors file (auto)",
                         lambda: gst.load_file(st_path, device=device)))
    rows.append(_attempt(torch, want, "gdskit loads the torch.save file (auto)",
                         lambda: gtorch.load(pt_path, map_location=device)))

    on_gpu = device.startswith("cuda")
    mode = "bounce" if on_gpu else "host"
    allowed = {"bounce-cached", "bounce-direct"} if on_gpu else {"host"}
    with gdskit.settings.set(mode=mode):
        rows.append(_attempt(torch, want, f"fallback path (mode={mode}) loads the safetensors file",
                             lambda: gst.load_file(st_path, device=device), allowed))
        rows.append(_attempt(torch, want, f"fallback path (mode={mode}) loads the torch.save file",
                             lambda: gtorch.load(pt_path, map_location=device), allowed))
    return {"bytes": total, "device": device, "checks": rows}
