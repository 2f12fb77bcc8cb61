"""The default workload of ``gdskit accept`` (item 5), and the raw round trip the fault cases share.

Run as a child process::

    python -m gdskit.accept.workload --dir D --size 2G [--device 0]

With torch it saves a checkpoint of ``--size`` bytes through ``gdskit.safetensors``
(from GPU memory when there is a GPU), evicts it from the page cache, loads it
back and compares every byte. Without torch it does the same with raw bytes
through ``gdskit.open``. It prints one JSON line (what moved, the ledger) and
exits 1 when the data differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import gdskit
from gdskit.settings import parse_size

MiB = 1 << 20
#: Each request is this large: above the engine's direct threshold, so ``auto`` mode may go direct.
CHUNK = 16 * MiB
#: The checkpoint's tensors are this large (plus two small odd-sized ones, as real checkpoints have).
TENSOR_BYTES = 64 * MiB


def _cpu_path_bytes(ledger: dict[str, Any]) -> int:
    return ledger["total_bytes"] - ledger["direct_bytes"]


def _evict(path: str) -> None:
    """Drop the file's pages so the read comes from storage, not from the page cache."""
    from gdskit.bench.runner import make_cold  # noqa: PLC0415 - import time

    make_cold([path], drop_all=False)


def raw_round_trip(directory: str, nbytes: int, device: int | None, name: str = "gdskit-accept-raw.bin") -> dict[str, Any]:
    """Write ``nbytes`` of a known pattern through gdskit in ``auto`` mode, read it back, compare.

    ``device`` None uses host memory, else GPU memory on that device. The file is removed afterwards.
    """
    from gdskit.bench.memory import allocate, pattern  # noqa: PLC0415 - import time

    nbytes = max(4096, nbytes - nbytes % 4096)
    chunk = min(CHUNK, nbytes)
    on_device = device is not None
    wbuf = allocate(on_device, chunk, device or 0)
    try:
        rbuf = allocate(on_device, chunk, device or 0)
    except BaseException:
        wbuf.free()
        raise
    path = os.path.join(directory, name)
    first_bad = None
    before = gdskit.stats()
    try:
        with gdskit.open(path, "w") as f:
            for off in range(0, nbytes, chunk):
                n = min(chunk, nbytes - off)
                wbuf.load(pattern(off, n))
                f.write(wbuf.obj, n, off)
            f.fsync()
        _evict(path)
        with gdskit.open(path, "r") as f:
            for off in range(0, nbytes, chunk):
                n = min(chunk, nbytes - off)
                got = f.read(rbuf.obj, n, off)
                data = rbuf.to_host(got)
                if got != n or not (data == pattern(off, n)).all():
                    first_bad = off
                    break
        delta = (gdskit.stats() - before).to_dict()
    finally:
        wbuf.free()
        rbuf.free()
        try:
            os.unlink(path)
        except OSError:
            pass
    return {"kind": "raw", "bytes": nbytes, "memory": "device" if on_device else "host",
            "identical": first_bad is None, "first_mismatch_chunk": first_bad, "ledger": delta,
            "direct_bytes": delta["direct_bytes"], "cpu_path_bytes": _cpu_path_bytes(delta)}


def make_tensors(torch: Any, nbytes: int, device: str, tensor_bytes: int = TENSOR_BYTES) -> dict[str, Any]:
    """About ``nbytes`` of random bf16 tensors of ``tensor_bytes`` each, plus two small odd-sized ones."""
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(tensor_bytes, left) // 2
        if n == 0:
            break
        bits = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device=device, generator=gen)
        out[f"layers.{i}.weight"] = bits.view(torch.bfloat16)  # random bits: any bf16, NaNs included
        left -= 2 * n
        i += 1
    out["norm.weight"] = torch.arange(1031, dtype=torch.float32, device=device)  # odd size: unaligned tail
    out["head.bias"] = torch.arange(77, dtype=torch.int8, device=device)
    return out


def same_bytes(torch: Any, a: Any, b: Any) -> bool:
    """Bitwise equality (NaN payloads included), whatever the devices."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8).to(ab.device)
    return bool(torch.equal(ab, bb))


def checkpoint_round_trip(directory: str, nbytes: int, device: int | None) -> dict[str, Any]:
    """Save a checkpoint of ``nbytes`` with gdskit.safetensors, evict it, load it, compare."""
    import torch  # noqa: PLC0415 - optional dependency (torch)

    import gdskit.safetensors as gst  # noqa: PLC0415 - import time

    dev = f"cuda:{device}" if device is not None else "cpu"
    tensors = make_tensors(torch, nbytes, dev)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    path = os.path.join(directory, "gdskit-accept-workload.safetensors")
    before = gdskit.stats()
    try:
        t0 = time.perf_counter()
        gst.save_file(tensors, path, metadata={"format": "pt"})
        t1 = time.perf_counter()
        _evict(path)
        t2 = time.perf_counter()
        loaded = gst.load_file(path, device=dev)
        if device is not None:
            torch.cuda.synchronize(dev)
        t3 = time.perf_counter()
        identical = set(loaded) == set(tensors) and all(same_bytes(torch, tensors[k], loaded[k]) for k in tensors)
        delta = (gdskit.stats() - before).to_dict()
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return {"kind": "safetensors", "bytes": total, "tensors": len(tensors), "memory": dev,
            "identical": identical, "save_s": round(t1 - t0, 3), "load_s": round(t3 - t2, 3),
            "ledger": delta, "direct_bytes": delta["direct_bytes"], "cpu_path_bytes": _cpu_path_bytes(delta)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdskit.accept.workload",
                                 description="Save and load a checkpoint through gdskit and compare every byte.")
    ap.add_argument("--dir", required=True, help="directory for the checkpoint (removed afterwards)")
    ap.add_argument("--size", default="2G", help="checkpoint size, e.g. 256M, 2G")
    ap.add_argument("--device", type=int, default=0, help="GPU index (used when there is a GPU)")
    ap.add_argument("--raw", action="store_true", help="raw bytes through gdskit.open even when torch is installed")
    args = ap.parse_args(argv)

    from gdskit.engine import cuda  # noqa: PLC0415 - import time

    device = args.device if cuda.device_count() > args.device else None
    nbytes = parse_size(args.size)
    try:
        import torch  # noqa: F401, PLC0415 - optional dependency (torch)
        have_torch = not args.raw
    except ImportError:
        have_torch = False
    out = (checkpoint_round_trip if have_torch else raw_round_trip)(args.dir, nbytes, device)
    print(json.dumps(out))
    return 0 if out["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
