"""Live proof (``gdskit check --probe``): move one small aligned block through gdskit
on each checked mount and report the path the ledger recorded.

The verdict of a mount is a prediction from platform facts; the ledger (filled
from cuFile's own counters where cuFile ran) is evidence. When they disagree the
probe adds a finding. A temporary file is written and removed; nothing else changes.
"""

from __future__ import annotations

import os
from typing import Any

from gdskit import engine
from gdskit.durable import create_temp_file, fd_path
from gdskit.machine.mounts import odirect_dir_for, read_mounts
from gdskit.machine.root import SystemRoot
from gdskit.probe.verdict import Finding, MountCheck
from gdskit.settings import settings
from gdskit.vocabulary import Reason, is_direct_path


def _ledger_view(delta: Any) -> dict[str, Any]:
    paths: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for e in delta.entries:
        if e.bytes <= 0:
            continue
        paths[e.path] = paths.get(e.path, 0) + e.bytes
        reasons[e.reason] = reasons.get(e.reason, 0) + e.bytes
    return {"paths": paths, "reasons": reasons}


def probe_directory(directory: str, nbytes: int, on_gpu: bool) -> dict[str, Any]:
    """Write then read ``nbytes`` through ``gdskit.open`` in a temp file in ``directory``."""
    import numpy as np  # noqa: PLC0415 - import time

    pattern = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    tmp: str | None = None
    blocks: list[Any] = []
    result: dict[str, Any] = {"status": "failed", "directory": directory, "bytes": nbytes,
                              "memory": "device" if on_gpu else "host"}
    try:
        held, tmp = create_temp_file(directory, ".gdskit-probe-")
        own = fd_path(held)  # the file made here, whatever another user puts at its name
        if on_gpu:
            cuda = engine.cuda_layer()
            src = cuda.DeviceArray(nbytes)
            blocks.append(src)  # freed below even if the second allocation fails
            dst = cuda.DeviceArray(nbytes)
            blocks.append(dst)
            src.copy_from_host(pattern)
        else:
            src, dst = pattern, np.zeros(nbytes, dtype=np.uint8)
        counters0 = engine.cufile_counters(0)
        s0 = engine.stats()
        with engine.open_file(own, "w") as f:
            written = f.write(src)
            f.fsync()
        s1 = engine.stats()
        with engine.open_file(own, "r") as f:
            read = f.read(dst)
        s2 = engine.stats()
        counters1 = engine.cufile_counters(0)
        if on_gpu:
            back = dst.to_numpy()
        else:
            back = dst
        with open(own, "rb") as fh:
            on_disk = fh.read()
        result.update({
            "status": "ok",
            "bytes_written": written, "bytes_read": read,
            "data_verified": bool(on_disk == pattern.tobytes() and np.array_equal(back, pattern)),
            "write": _ledger_view(s1 - s0),
            "read": _ledger_view(s2 - s1),
        })
        if counters0 is not None and counters1 is not None:
            result["cufile_counters"] = {k: counters1[k] - counters0.get(k, 0) for k in counters1}
    except Exception as exc:  # report, never crash the check
        result["error"] = f"{type(exc).__name__}: {exc}"
        reason = getattr(exc, "reason", None)
        if reason is not None:
            result["reason"] = str(reason)
    finally:
        for b in blocks:
            b.free()
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            os.close(held)
    return result


def _summary(res: dict[str, Any]) -> str:
    if res.get("status") != "ok":
        return f"failed: {res.get('error', res.get('detail', 'unknown'))}"

    def side(view: dict[str, Any]) -> str:
        paths = ", ".join(sorted(view["paths"])) or "none"
        reasons = ", ".join(sorted(r for r in view["reasons"] if r != "direct"))
        return paths + (f" ({reasons})" if reasons else "")

    ok = "" if res.get("data_verified") else "; DATA MISMATCH"
    return f"write: {side(res['write'])}; read: {side(res['read'])}{ok}"


def live_probe(report: Any, root: SystemRoot) -> None:
    """Fill ``probe`` of every mount in ``report`` and add findings where evidence contradicts the verdict."""
    report.probed = True
    if not root.is_live:
        report.notes.append("--probe needs the live machine; not run on a captured tree")
        for mc in report.mounts:
            mc.probe = {"status": "skipped", "detail": "captured tree", "summary": "skipped"}
        return
    cuda = engine.cuda_layer()
    on_gpu = cuda.device_count() > 0
    align = settings.alignment
    nbytes = max(settings.direct_threshold, 1 << 20)
    nbytes = (nbytes + align - 1) // align * align
    mounts = {m.mountpoint: m for m in read_mounts(root)}
    for mc in report.mounts:
        entry = mounts.get(mc.mountpoint)
        directory = odirect_dir_for(entry, mc.requested) if entry is not None and not entry.read_only else None
        if directory is None:
            mc.probe = {"status": "skipped", "detail": "no writable directory on this mount", "summary": "skipped"}
            continue
        res = probe_directory(directory, nbytes, on_gpu)
        res["summary"] = _summary(res)
        mc.probe = res
        report.findings.extend(_probe_findings(mc, res))


def _probe_findings(mc: MountCheck, res: dict[str, Any]) -> list[Finding]:
    subj = f"mount {mc.mountpoint}"
    if res.get("status") != "ok":
        return [Finding("probe.failed", "error", subj, f"gdskit could not read and write here: {res.get('error')}",
                        "Workloads on this mount will fail the same way.",
                        "Check permissions and free space; run again with GDSKIT_MODE=bounce to isolate cuFile.",
                        res.get("reason"))]
    out = []
    if not res.get("data_verified"):
        out.append(Finding("probe.data_mismatch", "error", subj, "bytes read back differ from bytes written",
                           "Data corruption on this path.", "Report this with the probe output."))
    seen = set(res["write"]["paths"]) | set(res["read"]["paths"])
    direct_seen = {p for p in seen if is_direct_path(p)}
    if mc.verdict == "direct" and not direct_seen:
        reasons = sorted((set(res["write"]["reasons"]) | set(res["read"]["reasons"])) - {Reason.DIRECT.value})
        out.append(Finding("probe.not_direct", "error", subj,
                           f"predicted direct, but the ledger recorded {', '.join(sorted(seen))}",
                           "The direct path is not active despite the platform facts.",
                           "See the recorded reasons (" + ", ".join(reasons) + ") and cuFile's log.",
                           reasons[0] if reasons else None))
    elif mc.verdict != "direct" and direct_seen:
        out.append(Finding("probe.direct_despite_verdict", "info", subj,
                           f"the ledger recorded {', '.join(sorted(direct_seen))} although the check predicted "
                           f"{mc.verdict}", "The direct path works here; the prediction was too cautious.",
                           "Report the check output so the prediction can be corrected."))
    return out


__all__ = ["live_probe", "probe_directory"]
