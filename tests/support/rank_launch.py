"""Start one process per rank of a multi-process test and collect the report each rank wrote.

A rank's worker script is run as ``python SCRIPT NAME RANK WORLD WORKDIR *extra``; it writes its
log to ``WORKDIR/NAME.RANK.log`` (its stdout and stderr) and its report to ``WORKDIR/NAME.RANK.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from repo_paths import child_pythonpath

#: NVLink multicast (NVLS) stays off: the machines these tests run on do not allow it.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_ranks(script: Path, name: str, world: int, workdir: Path, extra: tuple[str, ...] = (),
              exit_status: dict[int, int] | None = None, timeout_s: float = 240) -> dict[int, Any]:
    """Run ``script`` on ``world`` ranks; {rank: its JSON report}.

    Fails (AssertionError, with the log's tail) if a rank exits with another status than 0 (or
    than ``exit_status[rank]``, for a rank a test kills on purpose), hangs past ``timeout_s`` or
    reports nothing; every process is ended before returning.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(script.parent)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(NO_MULTICAST)
    env["OMP_NUM_THREADS"] = "1"
    procs, logs = [], []
    try:
        for rank in range(world):
            log = open(workdir / f"{name}.{rank}.log", "w")  # noqa: SIM115 - closed below, after the ranks end
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(script), name, str(rank), str(world), str(workdir),
                                           *extra], env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
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
    reports: dict[int, Any] = {}
    problems = []
    for rank, p in enumerate(procs):
        expected = (exit_status or {}).get(rank, 0)
        report = workdir / f"{name}.{rank}.json"
        if p.returncode != expected or not report.exists():
            tail = (workdir / f"{name}.{rank}.log").read_text()[-4000:]
            problems.append(f"rank {rank} exited with {p.returncode} (expected {expected}):\n{tail}")
            continue
        reports[rank] = json.loads(report.read_text())
    assert not problems, "\n".join(problems)
    return reports
