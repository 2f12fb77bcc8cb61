"""Item 7: take the direct path away three ways and check the workload degrades, completes and keeps its data.

Each case runs in its own child process (:mod:`gdskit.accept.fault_child`), so a
fault never leaks into this process and a crash shows as a signal, not as a
dead ``gdskit accept``:

``compat``    cuFile forced into compat mode by a cufile.json (``CUFILE_ENV_PATH_JSON``);
``register``  gdskit's cuFile backend made to fail handle registration;
``tmpfs``     the target on a filesystem with no direct path (``/dev/shm``).

A case passes when the child exits normally, every byte read back equals what was
written, no byte took the direct path, and every byte took a CPU path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from gdskit.accept.context import AcceptContext
from gdskit.accept.fault_child import CASES
from gdskit.accept.result import FAIL, NA, PASS
from gdskit.durable import read_whole_file

TMPFS_DIR = "/dev/shm"
CPU_PATHS = ("bounce-cached", "bounce-direct", "host", "cufile-compat")

DESCRIPTIONS = {
    "compat": "cuFile forced into compat mode (cufile.json force_compat_mode, in a child)",
    "register": "gdskit's cuFile backend fails handle registration (in a child)",
    "tmpfs": f"target on tmpfs ({TMPFS_DIR}), a filesystem with no direct path",
}


def forced_compat_config(directory: str) -> str:
    """A copy of the effective cufile.json with compat mode allowed and forced; returns its path.

    cuFile's log goes to ``directory`` so that the child leaves nothing behind.
    """
    from gdskit.machine.gds import DEFAULT_CUFILE_JSON, parse_cufile_json  # noqa: PLC0415 - import time

    source = os.environ.get("CUFILE_ENV_PATH_JSON") or DEFAULT_CUFILE_JSON
    data: dict[str, Any] = {}
    try:
        data = parse_cufile_json(read_whole_file(source).decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        pass  # no configuration or an unreadable one: cuFile's defaults plus the forcing below
    props = data.get("properties") if isinstance(data.get("properties"), dict) else {}
    data["properties"] = {**props, "allow_compat_mode": True, "force_compat_mode": True}
    logging = data.get("logging") if isinstance(data.get("logging"), dict) else {}
    data["logging"] = {**logging, "dir": directory}
    path = os.path.join(directory, "cufile.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
    return path


def is_tmpfs(path: str) -> bool:
    from gdskit.bench.machine import mount_for  # noqa: PLC0415 - import time

    m = mount_for(path) if os.path.isdir(path) else None
    return m is not None and m.fstype == "tmpfs"


def _child_result(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _paths_text(ledger: dict[str, Any]) -> str:
    paths = ledger.get("paths", {})
    reasons = ledger.get("reasons", {})
    p = ", ".join(f"{k} {(v['bytes_read'] + v['bytes_written']) >> 20} MiB" for k, v in sorted(paths.items()))
    r = ", ".join(sorted(reasons))
    return f"{p or 'nothing'} (reasons: {r or '-'})"


def judge(case: str, proc_rc: int, stdout: str, stderr: str) -> dict[str, Any]:
    """Turn one child's exit status and output into the case's status, detail and fix."""
    row: dict[str, Any] = {"case": case, "description": DESCRIPTIONS[case], "returncode": proc_rc}
    if proc_rc < 0:
        name = signal.Signals(-proc_rc).name if -proc_rc in signal.Signals._value2member_map_ else str(-proc_rc)
        return {**row, "status": FAIL, "detail": f"the child crashed ({name}): {_last_line(stderr)}",
                "fix": "A crash under a fault is a gdskit bug: report it with faults.json."}
    out = _child_result(stdout)
    if proc_rc != 0 or out is None:
        return {**row, "status": FAIL, "detail": f"the child failed (exit status {proc_rc}): {_last_line(stderr)}",
                "fix": "The workload must survive a missing direct path: report it with faults.json."}
    row["child"] = out
    auto = out["auto"]
    moved = auto["ledger"]["total_bytes"]
    if not auto["identical"]:
        return {**row, "status": FAIL, "detail": "the data read back differ from what was written",
                "fix": "Data corruption on the fallback path is a gdskit bug: report it with faults.json."}
    if auto["direct_bytes"] > 0:
        return {**row, "status": FAIL,
                "detail": f"{auto['direct_bytes']} bytes still took the direct path: the fault did not take effect",
                "fix": "The fault could not be injected here; see faults.json."}
    stray = {p for p in auto["ledger"]["paths"] if p not in CPU_PATHS}
    if stray or moved < 2 * auto["bytes"]:
        return {**row, "status": FAIL, "detail": f"unexpected ledger: {_paths_text(auto['ledger'])}",
                "fix": "Report it with faults.json."}
    detail = (f"{auto['bytes'] >> 20} MiB of {auto['memory']} memory written and read back identical through "
              + _paths_text(auto["ledger"]))
    reg = out.get("registration")
    if reg is not None:
        detail += (f"; cuFileHandleRegister refused {reg['refused']} time(s)" if reg["refused"]
                   else f"; registration was never reached ({reg.get('note') or 'the router chose another path first'})")
    forced = out.get("cufile_mode")
    if forced is not None:
        if forced.get("refused"):
            detail += f"; mode=cufile: cuFile refused the file ({forced['reason']}) without crashing"
        elif not forced["identical"] or forced["direct_bytes"]:
            return {**row, "status": FAIL, "detail": "with mode=cufile under forced compat mode: "
                    + ("data differ" if not forced["identical"] else f"{forced['direct_bytes']} bytes went direct"),
                    "fix": "cuFile ignored force_compat_mode or lost data: report it with faults.json."}
        else:
            detail += f"; mode=cufile: identical through {_paths_text(forced['ledger'])}"
    return {**row, "status": PASS, "detail": detail}


def run_case(ctx: AcceptContext, case: str) -> dict[str, Any]:
    """Run one fault case in a child process and judge it."""
    if case in ("compat", "register") and not ctx.has_gpu:
        return {"case": case, "description": DESCRIPTIONS[case], "status": NA,
                "detail": "no GPU: the workload never uses cuFile, so there is no direct path to take away"}
    if case == "tmpfs" and not is_tmpfs(TMPFS_DIR):
        return {"case": case, "description": DESCRIPTIONS[case], "status": NA,
                "detail": f"no tmpfs mounted at {TMPFS_DIR}"}
    scratch = tempfile.mkdtemp(prefix=".gdskit-accept-fault-", dir=TMPFS_DIR if case == "tmpfs" else ctx.work_dir)
    try:  # from here on the scratch directory is removed whatever happens
        env = {**os.environ, "GDSKIT_MODE": "auto"}  # the fallback under test is auto mode's
        if case == "compat":
            env.update(CUFILE_ENV_PATH_JSON=forced_compat_config(scratch), CUFILE_FORCE_COMPAT_MODE="true",
                       CUFILE_ALLOW_COMPAT_MODE="true")
        # -X faulthandler: should the child crash, its stderr (kept in the report) shows where.
        argv = [sys.executable, "-X", "faulthandler", "-m", "gdskit.accept.fault_child", "--case", case,
                "--dir", scratch, "--size", str(ctx.sizes.fault), "--device", str(ctx.options.device)]
        proc = subprocess.run(argv, env=env, cwd=scratch, capture_output=True, text=True,
                              timeout=ctx.options.timeout)
    except subprocess.TimeoutExpired:
        return {"case": case, "description": DESCRIPTIONS[case], "status": FAIL,
                "detail": f"the child did not finish within {ctx.options.timeout:.0f} s (killed)",
                "fix": "A hang under a fault is a gdskit bug: report it."}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    row = judge(case, proc.returncode, proc.stdout, proc.stderr)
    row["stderr_tail"] = proc.stderr[-2000:]
    return row


def run_cases(ctx: AcceptContext) -> list[dict[str, Any]]:
    return [run_case(ctx, case) for case in CASES]
