"""A fresh process's first read pays its set-up once, and no more than it does today.

Not a timing test: a child interpreter on the stand-in driver counts what the first call does
that the second does not (driver calls by name, files opened under /sys, /proc, /etc, /run and
/dev, pinned bytes registered before the first byte is read, threads started), and the test
fails when any count grows past the budget written here. A change that needs more set-up
raises the budget in the same commit, with the reason (docs/engine.md, "What a first call
costs")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import SRC, STAND_INS

#: One stage of a lane: the chunk (8 MiB) and two alignments (the O_DIRECT edges).
ONE_STAGE = (8 << 20) + 2 * 4096

_CHILD = r"""
import collections, json, os, sys, threading
sys.path[:0] = [sys.argv[1], sys.argv[2]]
events = []
log = [False]
WATCHED = ("/sys", "/proc", "/etc", "/run", "/dev")

def hook(event, args):
    if not log[0]:
        return
    if event == "open" and isinstance(args[0], str) and args[0].startswith(WATCHED):
        events.append(("file", args[0]))
    elif event in ("os.listdir", "os.scandir") and isinstance(args[0], str) and args[0].startswith(WATCHED):
        events.append(("file", args[0]))

import gdskit
from gdskit.engine import cuda
from fake_cuda import FakeDriver

class Counted(FakeDriver):
    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if log[0] and name.startswith("cu") and callable(value):
            events.append(("driver", name))
        return value

    def cuMemHostRegister(self, ptr, n, flags):
        events.append(("pin", n, threading.get_ident()))
        return super().cuMemHostRegister(ptr, n, flags)

    def cuMemHostAlloc(self, n, flags):
        events.append(("pin", n, threading.get_ident()))
        return super().cuMemHostAlloc(n, flags)

real_preadv, real_pread = os.preadv, os.pread
def preadv(fd, bufs, offset, *rest):
    events.append(("read", fd, threading.get_ident()))
    return real_preadv(fd, bufs, offset, *rest)
def pread(fd, n, offset):
    events.append(("read", fd, threading.get_ident()))
    return real_pread(fd, n, offset)
os.preadv, os.pread = preadv, pread
sys.addaudithook(hook)

scenario, paths = sys.argv[3], sys.argv[4:]
out = {}
with cuda.use_driver(Counted()):
    sizes = [os.path.getsize(p) for p in paths]
    dests = [cuda.DeviceArray(n) for n in sizes]  # the caller's memory, made before the call
    threads_before = threading.active_count()
    for call in ("first", "second"):
        start = len(events)
        log[0] = True
        if scenario == "host":
            with gdskit.open(paths[0]) as f:
                got = [f.read(bytearray(sizes[0]), sizes[0], 0)]
        elif scenario == "one-file":
            with gdskit.open(paths[0]) as f:
                got = [f.read(dests[0], sizes[0], 0)]
        else:
            got = [c[0] for c in gdskit.engine.read_files([(p, [(d, n, 0)]) for p, d, n in zip(paths, dests, sizes)])]
        log[0] = False
        assert got == sizes, (got, sizes)
        seen = events[start:]
        first_read = next((i for i, e in enumerate(seen) if e[0] == "read"), len(seen))
        reader = seen[first_read][2] if first_read < len(seen) else None
        out[call] = {
            "driver": dict(collections.Counter(e[1] for e in seen if e[0] == "driver")),
            "files": sorted({e[1] for e in seen if e[0] == "file"}),
            "pinned_before_first_read": sum(e[1] for e in seen[:first_read] if e[0] == "pin"),
            "pinned_by_the_first_reader": sum(e[1] for e in seen[:first_read] if e[0] == "pin" and e[2] == reader),
            "pinned": sum(e[1] for e in seen if e[0] == "pin"),
            "threads": threading.active_count() - threads_before,
        }
    for d in dests:
        d.free()
print("COUNTS " + json.dumps(out))
"""


def _counts(tmp_path: Path, scenario: str, sizes: list[int]) -> dict:
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(os.urandom(n))
        paths.append(str(p))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKIT_")}
    env.update(GDSKIT_THREADS="4", GDSKIT_CHUNK_SIZE="8MiB", GDSKIT_STATS="0", GDSKIT_STATS_DIR=str(tmp_path / "stats"))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(SRC), str(STAND_INS), scenario, *paths],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("COUNTS "))
    return json.loads(line[len("COUNTS "):])


#: What a first call may do, per scenario: driver calls beyond the second call's (47 with four
#: workers: per lane a stream, a registration, two events and its context checks; the device
#: count, handle and bus id once), files read under the system's
#: folders (today: cufile.json, nvidia-fs's version, /proc/modules for the direct route; the
#: GPU's NUMA node for the lanes), pinned bytes before the first read (the workers make their
#: stages at once, so how many exist when the first byte is read depends on timing: at most one
#: per worker; the worker that reads first has made its own stage only), threads started (the
#: four workers).
#: A read into host memory asks the driver only how many GPUs there are (the ledger's reason says
#: ``no_gpu`` or ``host_memory``) and reads no machine facts.
BUDGET = {
    "host": {"driver": 1, "files": 0, "pinned_before_first_read": 0, "threads": 4},
    "one-file": {"driver": 47, "files": 5, "pinned_before_first_read": 4 * ONE_STAGE, "threads": 4},
    "many-files": {"driver": 47, "files": 5, "pinned_before_first_read": 4 * ONE_STAGE, "threads": 4},
}
#: Set-up a second call must never repeat.
SET_UP_CALLS = {"cuInit", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetPCIBusId", "cuDevicePrimaryCtxRetain",
                "cuStreamCreate", "cuStreamCreateWithPriority", "cuMemHostRegister", "cuMemHostAlloc",
                "cuEventCreate"}


@pytest.mark.parametrize("scenario, sizes", [("host", [64 << 20]), ("one-file", [64 << 20]),
                                             ("many-files", [(1 << 20) + 4096 * i for i in range(24)])])
def test_a_first_call_pays_no_more_set_up_than_its_budget_and_a_second_none(tmp_path, scenario, sizes):
    counts = _counts(tmp_path, scenario, sizes)
    first, second, budget = counts["first"], counts["second"], BUDGET[scenario]
    set_up = {name: n - second["driver"].get(name, 0) for name, n in first["driver"].items()
              if n > second["driver"].get(name, 0)}  # what the first call did that the second did not
    assert sum(set_up.values()) <= budget["driver"], (sum(set_up.values()), set_up)
    assert len(first["files"]) <= budget["files"], first["files"]
    assert first["pinned_before_first_read"] <= budget["pinned_before_first_read"], first
    assert (first["pinned_before_first_read"] > 0) == (scenario != "host"), first
    assert first["pinned_by_the_first_reader"] == (0 if scenario == "host" else ONE_STAGE), first
    assert first["threads"] <= budget["threads"], first
    # The second call: nothing of the set-up again.
    assert second["files"] == [] and second["pinned"] == 0, second
    # The worker pool starts its threads as work asks for them, up to its size: never past it.
    assert second["threads"] <= budget["threads"], second
    assert not SET_UP_CALLS & set(second["driver"]), second["driver"]


def test_the_gpus_numa_place_is_asked_once_when_lanes_ask_at_once(fake_cuda):
    """The lanes of a first call are made by all workers at once, and each asks where its GPU
    sits: one of them reads the place, the others wait for its answer."""
    import threading
    import time

    from gdskit.engine import numa

    asked = []

    def slow_source(bus_id):
        asked.append(bus_id)
        time.sleep(0.05)
        return numa.UNKNOWN

    barrier = threading.Barrier(8)

    def ask():
        barrier.wait()
        numa.place_of(0)

    with numa.use_facts(slow_source):
        workers = [threading.Thread(target=ask) for _ in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert len(asked) == 1, asked
