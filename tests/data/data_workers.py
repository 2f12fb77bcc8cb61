"""Files for the gdskit.data tests, and the ranks of their multi-process runs.

As a script, ``python data_workers.py WORLDS WORKDIR`` (``WORLDS``: e.g. ``1,2,4``) forks every
rank of every world; each joins its world's gloo process group, runs every scenario in order
and writes ``WORKDIR/data.WORLD.RANK.json``:
``{scenario: what this rank saw}`` (the first token of each window it was handed, per epoch;
whether a wrong state was refused...). The test compares the ranks' reports with each other
and with the files. Kept outside ``test_*`` so pytest does not collect it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

#: Window starts are unique across files: file f's token at position p is f * FILE_STRIDE + p.
FILE_STRIDE = 1_000_000


def token_files(directory: Path, tokens_per_file: list[int], dtype: str = "uint32") -> list[str]:
    """Token files whose every token says where it is (file ``f``, position ``p``: ``f * FILE_STRIDE + p``)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for f, n in enumerate(tokens_per_file):
        p = directory / f"tokens{f:02d}.bin"
        (np.arange(n, dtype=np.int64) + f * FILE_STRIDE).astype(dtype).tofile(p)
        paths.append(str(p))
    return paths


#: The loader tests' small token set: four uint32 files of windows of LOADER_SEQ tokens.
LOADER_SEQ = 32
LOADER_TOKENS = [1000, 400, 97, 650]  # 31 + 12 + 3 + 20 = 66 windows


def loader_tokens(directory: Path) -> tuple[list[str], list[np.ndarray]]:
    """The loader tests' token files in ``directory`` and every window of them, read by numpy."""
    paths = token_files(directory, LOADER_TOKENS, "uint32")
    return paths, windows(paths, "uint32", LOADER_SEQ)


def windows(paths: list[str], dtype: str, seq_len: int) -> list[np.ndarray]:
    """Every window of the token files, in dataset order, read by numpy."""
    out = []
    for p in paths:
        a = np.fromfile(p, dtype=dtype)
        out += [a[i * seq_len:i * seq_len + seq_len + 1] for i in range(max(0, (len(a) - 1) // seq_len))]
    return out


# -- the multi-process runs -------------------------------------------------------------------------

TOKENS = [5000, 3001, 2049, 4100, 700]   # 2+1+1+2+0 windows of 2048: window counts that divide unevenly
SEQ_LEN = 512


def run_worlds(worlds: tuple[int, ...], workdir: Path, timeout_s: float = 240) -> dict[int, dict[int, Any]]:
    """Run every scenario on each of ``worlds`` at once, each its own gloo group; {world: {rank:
    report}}. One launcher process imports torch and gdskit once and forks every rank (on a small
    machine torch's import is most of the cost). Fails (AssertionError) if a rank fails, the run
    hangs past ``timeout_s`` or a rank reports nothing; every process is ended before returning."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GDSKIT_THREADS"] = "2"
    cmd = [sys.executable, str(HERE / "data_workers.py"), ",".join(map(str, worlds)), str(workdir)]
    with open(workdir / "launcher.log", "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    out: dict[int, dict[int, Any]] = {w: {} for w in worlds}
    problems = [] if p.returncode == 0 else [f"launcher exited with {p.returncode}"]
    for world in worlds:
        for rank in range(world):
            path = workdir / f"data.{world}.{rank}.json"
            if path.exists():
                out[world][rank] = json.loads(path.read_text())
            else:
                problems.append(f"rank {rank} of {world} reported nothing")
    if problems:
        logs = "".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(workdir.glob("*.log")))
        raise AssertionError("\n".join(problems) + "\n" + logs)
    return out


def launch(worlds: list[int], workdir: Path) -> int:
    """Fork a process per rank of every world (torch and gdskit already imported), wait for all;
    the exit status is 0 only if every rank's was. Ranks still running after 200 s are killed."""
    import signal

    import torch.distributed  # noqa: F401 - imported once, before the forks
    import gdskit.data  # noqa: F401

    children = {}
    for world in worlds:
        for rank in range(world):
            pid = os.fork()
            if pid == 0:  # a rank: its output to its own log, then out without the parent's exit handlers
                code = 1
                try:
                    fd = os.open(workdir / f"data.{world}.{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    rank_main(rank, world, workdir)
                    code = 0
                except BaseException:  # noqa: BLE001 - reported in the rank's log
                    import traceback
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children[pid] = (world, rank)
    failed = 0
    deadline = time.monotonic() + 200
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for p in children:
                    os.kill(p, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        children.pop(pid, None)
        failed += os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


def _firsts(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b[:, 0].tolist()]


def rank_main(rank: int, world: int, workdir: Path) -> None:
    import torch.distributed as dist

    import gdskit.data as gd
    from gdskit.errors import GdskitError

    store = workdir / f"store.{world}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    files = sorted(str(p) for p in (workdir / "tokens").glob("*.bin"))
    ds = gd.TokenDataset(files, dtype="uint32", seq_len=SEQ_LEN)
    every = windows(files, "uint32", SEQ_LEN)  # read by numpy, in dataset order
    report: dict[str, Any] = {"len_dataset": len(ds)}

    # Ranks from torch.distributed; every window's first token, per epoch, with and without drop_last.
    for drop_last in (False, True):
        with gd.Loader(ds, 3, device="cpu", shuffle=True, seed=11, drop_last=drop_last, prefetch=2) as loader:
            report[f"rank_world_{drop_last}"] = [loader.rank, loader.world_size, len(loader)]
            epochs = []
            for epoch in range(3):
                loader.set_epoch(epoch)
                batches = list(loader)
                ok = all(np.array_equal(b.numpy(), np.stack([every[i] for i in idx.tolist()]))
                         for b, idx in zip(batches, loader.batch_indices(epoch)))
                epochs.append({"firsts": _firsts(batches), "sizes": [len(b) for b in batches], "contents": ok})
            report[f"epochs_{drop_last}"] = epochs
            report[f"stats_{drop_last}"] = loader.stats().bytes_read

    # The same seed and epoch in a fresh loader: the same order.
    with gd.Loader(ds, 3, device="cpu", shuffle=True, seed=11, prefetch=1) as again:
        again.set_epoch(1)
        report["again_epoch1"] = _firsts(list(again))

    # Resume after k batches, mid-prefetch: the rest of the epoch, in order.
    with gd.Loader(ds, 2, device="cpu", shuffle=True, seed=3, prefetch=3) as full:
        full.set_epoch(2)
        whole = _firsts(list(full))
    with gd.Loader(ds, 2, device="cpu", shuffle=True, seed=3, prefetch=3) as first:
        first.set_epoch(2)
        it = iter(first)
        head = _firsts([next(it)])
        state = first.state_dict()
        dist.barrier()  # every rank has its read-ahead under way here
    with gd.Loader(ds, 2, device="cpu", shuffle=True, seed=3, prefetch=3) as second:
        second.load_state_dict(state)
        second.set_epoch(2)  # the same epoch: the position stays
        rest = _firsts(list(second))
    report["resume"] = {"whole": whole, "head": head, "rest": rest, "epoch_after": second.epoch}

    # A state from another world size is refused.
    other = dict(state, world_size=world + 1)
    try:
        gd.Loader(ds, 2, device="cpu", shuffle=True, seed=3).load_state_dict(other)
        report["other_world_refused"] = None
    except GdskitError as exc:
        report["other_world_refused"] = type(exc).__name__

    (workdir / f"data.{world}.{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(launch([int(w) for w in sys.argv[1].split(",")], Path(sys.argv[2])))
