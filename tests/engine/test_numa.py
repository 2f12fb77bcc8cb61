"""NUMA placement of the bounce path (gdskit.engine.numa): the memory policy and CPU affinity it sets
and puts back, the facts from sysfs, and the lanes and workers of a bounce read on the stand-in."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import gdskit
from gdskit.engine import cuda, numa, pool
from gdskit.engine.backends import bounce
from gdskit.machine.numa import NumaPlace, parse_cpulist
from gdskit.machine.root import SystemRoot
from gdskit.machine.numa import numa_place

from check_helpers import fixture_root

needs_policy = pytest.mark.skipif(numa.current_policy() is None, reason="no set_mempolicy on this platform")
needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")


def test_the_engines_numa_question_loads_no_storage_probe():
    """The first device lane asks where its GPU sits (on the way to a first read): that reads two
    sysfs files, and loads neither the mounts, topology nor routes probes (about 15 ms of imports,
    on the H200 machine, while the other lanes waited)."""
    import subprocess
    import sys

    code = ("import sys, gdskit, gdskit.engine.numa\n"
            "place = gdskit.engine.numa._source('0000:00:00.0')\n"
            "print(type(place).__name__, sorted(m for m in sys.modules if m.startswith('gdskit.probe.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "NumaPlace"
    loaded = " ".join(out[1:])
    for heavy in ("mounts", "topology", "routes", "check", "gpus"):
        assert f"gdskit.probe.{heavy}'" not in loaded, loaded


@pytest.mark.parametrize("text, cpus", [
    ("0-3,8-11\n", {0, 1, 2, 3, 8, 9, 10, 11}), ("5", {5}), ("", set()), ("0-1,x,4", {0, 1, 4}), ("3-1", set()),
])
def test_cpulists(text, cpus):
    assert parse_cpulist(text) == frozenset(cpus)


def test_places_from_sysfs():
    root = SystemRoot(fixture_root("two-gpus-nvlink"))
    assert numa_place(root, "0000:03:00.0") == NumaPlace(0, frozenset(range(0, 16)) | frozenset(range(32, 48)))
    assert numa_place(root, "0000:83:00.0").node == 1
    assert numa_place(root, "0000:99:00.0") == numa.UNKNOWN
    vm = SystemRoot(fixture_root("vm-firecracker"))
    assert numa_place(vm, "0000:00:05.0").cpus == frozenset()


@needs_policy
def test_memory_on_prefers_the_node_and_puts_the_default_back():
    assert numa.current_policy() == (numa.MPOL_DEFAULT, frozenset())
    with numa.memory_on(0) as bound:
        assert bound and numa.current_policy() == (numa.MPOL_PREFERRED, frozenset({0}))
        with numa.memory_on(0) as inner:  # a policy of the thread's own is kept
            assert not inner and numa.current_policy() == (numa.MPOL_PREFERRED, frozenset({0}))
        assert numa.current_policy() == (numa.MPOL_PREFERRED, frozenset({0}))
    assert numa.current_policy() == (numa.MPOL_DEFAULT, frozenset())
    with numa.memory_on(None) as unknown:
        assert not unknown and numa.current_policy() == (numa.MPOL_DEFAULT, frozenset())
    with numa.memory_on(7) as missing, numa.memory_on(5000) as beyond:  # no such node: nothing changes, nothing fails
        assert not missing and not beyond and numa.current_policy() == (numa.MPOL_DEFAULT, frozenset())


@needs_affinity
def test_run_on_narrows_the_thread_and_restore_puts_it_back():
    before = frozenset(os.sched_getaffinity(0))
    one = min(before)
    seen = {}

    def other_thread():
        seen["other"] = frozenset(os.sched_getaffinity(0))

    prev = numa.run_on(frozenset({one}))
    try:
        if len(before) > 1:
            assert prev == before and os.sched_getaffinity(0) == {one}
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    finally:
        numa.restore_cpus(prev)
    assert frozenset(os.sched_getaffinity(0)) == before
    assert numa.run_on(frozenset()) is None and numa.run_on(frozenset({10_000})) is None
    assert numa.run_on(before) is None  # nothing to narrow


@pytest.mark.stand_in_gpu
@needs_affinity
def test_a_bounce_read_stages_on_the_gpus_node_with_its_workers_there(tmp_path, fake_cuda):
    data = os.urandom(2 << 20)
    path = tmp_path / "b.bin"
    path.write_bytes(data)
    caller = frozenset(os.sched_getaffinity(0))
    node_cpus = frozenset({min(caller)})
    seen: list[frozenset[int]] = []
    lock = threading.Lock()

    def record(_n: int) -> None:
        with lock:
            seen.append(frozenset(os.sched_getaffinity(0)))

    gdskit.release_resources()
    buf = cuda.DeviceArray(len(data))
    with numa.use_facts(lambda bus: NumaPlace(0, node_cpus)):
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=2), gdskit.open(path) as f:
            assert f.read_many([(buf, len(data), 0)], on_bytes=record) == [len(data)]
            usage = gdskit.resources()
            # The workers' affinity is theirs again: each of the two answers from its own thread.
            both = threading.Barrier(2)

            def affinity() -> frozenset[int]:
                both.wait(timeout=30)
                return frozenset(os.sched_getaffinity(0))

            ex = pool.io_executor(2)
            after = [f.result() for f in [ex.submit(affinity), ex.submit(affinity)]]
        gdskit.release_resources()
    assert buf.to_numpy().tobytes() == data
    assert seen and all(s == node_cpus for s in seen), "the workers ran on the GPU's node"
    assert frozenset(os.sched_getaffinity(0)) == caller, "the caller's affinity is its own again"
    assert after == [caller, caller], "so is the workers'"
    if numa.current_policy() is not None:
        assert usage.numa_nodes == (0,)
        assert numa.current_policy() == (numa.MPOL_DEFAULT, frozenset())
    # A read of one large chunk runs in the calling thread, on the node, and the thread gets its
    # own affinity back; a small one leaves the thread where it is (moving costs more than it saves).
    with numa.use_facts(lambda bus: NumaPlace(0, node_cpus)):
        with gdskit.settings.set(mode="bounce", chunk_size="2MiB", threads=2), gdskit.open(path) as f:
            assert f.read_many([(buf, bounce.NUMA_MOVE_MIN, 0)], on_bytes=record) == [bounce.NUMA_MOVE_MIN]
            assert seen[-1] == node_cpus and frozenset(os.sched_getaffinity(0)) == caller
            assert f.read_many([(buf, 4096, 0)], on_bytes=record) == [4096]
            assert seen[-1] == caller and frozenset(os.sched_getaffinity(0)) == caller
            # A batch moves once for all its reads, and back.
            assert f.read_batch(buf, [0, 8192], 4096) == [4096, 4096]
            assert frozenset(os.sched_getaffinity(0)) == caller
        gdskit.release_resources()
    # Without a known node nothing is placed.
    gdskit.release_resources()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=2), gdskit.open(path) as f:
        assert f.read(buf) == len(data)
        assert gdskit.resources().numa_nodes == ()
    assert np.array_equal(buf.to_numpy(), np.frombuffer(data, np.uint8))
