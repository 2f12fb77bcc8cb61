"""Start one process per rank for the DCP tests and collect what each rank reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def run_world(phase: str, world: int, workdir: Path, device: str = "cpu", timeout_s: float = 240) -> dict[int, Any]:
    """Run ``phase`` of ``dcp_workers.py`` on ``world`` ranks; {rank: {check: {"ok", "detail"}}}.

    Fails (AssertionError) if a rank exits non-zero, hangs past ``timeout_s`` or
    reports nothing; every process is ended before returning.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    if device == "cuda":
        # NVLink multicast (NVLS) stays off: the machines these tests run on do not allow it.
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    procs = []
    logs = []
    for rank in range(world):
        log = open(workdir / f"{phase}.{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "dcp_workers.py"), phase, str(rank), str(world),
                                       str(workdir), device], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
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
    out: dict[int, Any] = {}
    problems = []
    for rank, p in enumerate(procs):
        path = workdir / f"{phase}.{rank}.json"
        if p.returncode != 0 or not path.exists():
            tail = (workdir / f"{phase}.{rank}.log").read_text()[-3000:]
            problems.append(f"rank {rank} exited with {p.returncode}:\n{tail}")
            continue
        out[rank] = json.loads(path.read_text())
    assert not problems, "\n".join(problems)
    return out
