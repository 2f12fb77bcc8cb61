"""Mutations of real torch.save files, judged against torch.load (used by test_torch_hostile.py).

Run as a worker: ``python torch_fuzz.py WORKDIR [MODE]`` reads cases (``[base, seed]`` per line)
from stdin, and for each prints one JSON line ``{"case": i, "verdict": ..., "detail": ...}``
as soon as it is judged, so that the parent knows which case a dying worker was on.

A case passes when gdskit.torch.load (map_location None and "cpu") raises a GdskitError,
or returns exactly what ``torch.load(weights_only=True)`` returns for the same bytes
(structure, types, dtypes, shapes, strides, offsets, storage bytes, which storages are
shared); where torch.load refuses the bytes, gdskit must refuse them too.

In mode ``into`` (:func:`judge_into`) a case passes when gdskit.torch.load_into and
gdskit.torch.load decide alike: both refuse with the same class of GdskitError, or both
read the same values. The worker then runs with its address space capped (:func:`cap_memory`).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import struct
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

#: The bases each case mutates, by name; made by :func:`make_bases`.
BASES = ("state_dict", "gdskit_save", "large_storage", "deflated")
#: The bases of mode ``into``: every one a mapping of names to tensors and other values.
INTO_BASES = BASES
#: Address space a worker of mode ``into`` may add to what it has once torch is imported.
MEMORY_HEADROOM = 3 << 30


def make_bases(directory: Path) -> None:
    """Write the base files: real torch.save / gdskit.torch.save archives."""
    import torch

    import gdskit.torch as gt

    g = torch.Generator().manual_seed(7)
    sd: dict[str, Any] = collections.OrderedDict()
    sd["w"] = torch.randn(8, 6, generator=g)
    sd["w_t"] = sd["w"].t()
    sd["rows"] = sd["w"][2:5]
    sd["b"] = torch.randn(6, generator=g).to(torch.bfloat16)
    sd["i"] = torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4)
    sd["mask"] = torch.tensor([True, False, True])
    sd["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["empty"] = torch.empty(0, 3)
    sd["param"] = torch.nn.Parameter(torch.randn(4, generator=g))
    sd["nested"] = {"list": [torch.ones(2, dtype=torch.int16), (torch.zeros(3, dtype=torch.uint8), 7)],
                    "step": 12, "name": "adam", "lr": 0.5}
    torch.save(sd, directory / "state_dict")
    gt.save(sd, directory / "gdskit_save")
    big = torch.randn(270_000, generator=g)  # 1.08 MB: read straight into its storage, ahead of the unpickle
    torch.save({"big": big, "tail": big[-10:], "small": torch.arange(5)}, directory / "large_storage")
    # The same state dict with its storage records deflated (as a zip tool might rewrite it).
    with zipfile.ZipFile(directory / "state_dict") as src, \
            zipfile.ZipFile(directory / "deflated", "w") as dst:
        for info in src.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info), compress_type=method)


def _regions(data: bytes) -> list[tuple[int, int]]:
    """Byte ranges worth aiming at: the pickle (most of all), every local header, the central
    directory and end records."""
    import io
    out = []
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for info in zf.infolist():
                body = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
                out.append((info.header_offset, body))
                if info.filename.endswith("data.pkl"):
                    out.extend([(body, body + info.compress_size)] * 6)
    except zipfile.BadZipFile:
        pass
    central = data.find(b"PK\x01\x02")
    if central >= 0:
        out.extend([(central, len(data))] * 2)
    return out or [(0, len(data))]


_INTERESTING_32 = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFF, 0x10000)


def mutate(data: bytes, seed: int) -> tuple[bytes, list[str]]:
    """``data`` with 1-3 random mutations (deterministic in ``seed``) and what they were."""
    rng = random.Random(seed)
    buf = bytearray(data)
    regions = _regions(data)
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        lo, hi = rng.choice(regions) if rng.random() < 0.85 else (0, len(buf))
        hi = min(hi, len(buf))
        if hi <= lo:
            lo, hi = 0, len(buf)
        if not buf:
            break
        pos = rng.randrange(lo, hi)
        op = rng.choice(("flip", "flip", "byte", "byte", "int32", "insert", "delete", "truncate"))
        if op == "flip":
            bit = rng.randrange(8)
            buf[pos] ^= 1 << bit
            done.append(f"flip bit {bit} at {pos}")
        elif op == "byte":
            value = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
            buf[pos] = value
            done.append(f"byte {value:#x} at {pos}")
        elif op == "int32":
            value = rng.choice(_INTERESTING_32)
            buf[pos:pos + 4] = struct.pack("<I", value)
            done.append(f"int32 {value:#x} at {pos}")
        elif op == "insert":
            extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
            buf[pos:pos] = extra
            done.append(f"insert {extra.hex()} at {pos}")
        elif op == "delete":
            n = rng.randrange(1, 9)
            del buf[pos:pos + n]
            done.append(f"delete {n} at {pos}")
        else:
            del buf[pos:]
            done.append(f"truncate at {pos}")
    return bytes(buf), done


class _Describer:
    """A canonical, comparable description of a loaded object (storages named by first use)."""

    def __init__(self) -> None:
        self.storages: dict[int, tuple[Any, ...]] = {}

    def storage(self, s: Any) -> tuple[Any, ...]:
        import torch
        u = s._untyped_storage if isinstance(s, torch.storage.TypedStorage) else s
        found = self.storages.get(u._cdata)
        if found is None:
            if u.device.type == "meta" or u.nbytes() == 0:
                raw = b""
            else:
                view = torch.empty(0, dtype=torch.uint8, device=u.device).set_(u, 0, (u.nbytes(),), (1,))
                raw = view.cpu().numpy().tobytes()
            found = self.storages[u._cdata] = (len(self.storages), u.nbytes(), u.device.type, raw)
        return found

    def __call__(self, x: Any) -> Any:
        import torch
        if isinstance(x, torch.Tensor):
            return ("tensor", type(x).__name__, str(x.dtype), tuple(x.shape), x.stride(), x.storage_offset(),
                    x.requires_grad, self.storage(x.untyped_storage()))
        if isinstance(x, torch.storage.TypedStorage):
            return ("typed_storage", type(x).__name__, str(x.dtype), self.storage(x))
        if isinstance(x, torch.UntypedStorage):
            return ("untyped_storage", self.storage(x))
        if isinstance(x, dict):
            return (type(x).__name__, tuple((self(k), self(v)) for k, v in x.items()))
        if isinstance(x, (list, tuple, set, frozenset)):
            items = sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x
            return (type(x).__name__, tuple(self(v) for v in items))
        if isinstance(x, float):
            return ("float", repr(x))
        if x is None or isinstance(x, (bool, int, str, bytes, complex)):
            return (type(x).__name__, repr(x))
        return ("other", type(x).__module__, type(x).__qualname__, repr(x)[:200])


def judge(path: str) -> tuple[str, str]:
    """``(verdict, detail)`` for the file at ``path``; verdict "ok" or a failure class."""
    import torch

    import gdskit.torch as gt
    from gdskit.errors import GdskitError

    outcome = "refused"
    for ml in (None, "cpu"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref: Any = ("accepted", _Describer()(torch.load(path, map_location=ml, weights_only=True)))
        except Exception as exc:  # noqa: BLE001 - torch.load refuses in many ways
            ref = ("refused", type(exc).__name__)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = _Describer()(gt.load(path, map_location=ml))
        except GdskitError:
            continue
        except Exception as exc:  # noqa: BLE001 - exactly what the test is looking for
            return "not-a-gdskit-error", f"map_location={ml!r}: {type(exc).__name__}: {exc}"[:500]
        if ref[0] == "refused":
            return "accepted-what-torch-refuses", f"map_location={ml!r}: torch.load raised {ref[1]}"
        if got != ref[1]:
            return "different-data", f"map_location={ml!r}: gdskit {str(got)[:300]} torch {str(ref[1])[:300]}"
        outcome = "accepted"
    return "ok", outcome


def cap_memory() -> None:
    """Cap this process's address space at what it has now plus :data:`MEMORY_HEADROOM`."""
    import resource
    with open("/proc/self/status") as f:
        vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    cap = vm_kib * 1024 + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _plain_tensors(obj: Any) -> dict[str, Any] | None:
    """The tensors of a state dict load_into can fill from, by name; None where ``obj`` is not
    one (load_into refuses those by design: not a mapping, names that are not strings, a tensor
    that is not plain strided memory)."""
    import torch
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        return None
    out = {}
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            if v.layout is not torch.strided or v.is_quantized or type(v) not in (torch.Tensor, torch.nn.Parameter):
                return None
            out[k] = v
    return out


def _raw(t: Any) -> bytes:
    import torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def judge_into(path: str, fallback: dict[str, Any]) -> tuple[str, str]:
    """``(verdict, detail)``: load_into against load (map_location "cpu") on the file at ``path``.
    ``fallback``: the tensors of the unmutated base, the target where load refuses the file."""
    import torch

    import gdskit.torch as gt
    from gdskit.errors import GdskitError

    def attempt(fn: Any) -> tuple[Any, BaseException | None]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fn(), None
        except GdskitError as exc:
            return None, exc

    try:
        loaded, load_error = attempt(lambda: gt.load(path, map_location="cpu"))
        tensors = _plain_tensors(loaded) if load_error is None else fallback
        if tensors is None:
            return "ok", "not-a-state-dict"
        target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in tensors.items()}
        result, into_error = attempt(lambda: gt.load_into(target, path, strict=False))
    except Exception as exc:  # noqa: BLE001 - exactly what the test is looking for
        return "not-a-gdskit-error", f"{type(exc).__name__}: {exc}"[:500]
    if load_error is not None:
        if into_error is None:
            return "load-into-accepted-what-load-refuses", f"load raised {type(load_error).__name__}: {load_error}"[:500]
        if type(into_error) is not type(load_error):
            return "different-errors", f"load {type(load_error).__name__}: {load_error}; " \
                                       f"load_into {type(into_error).__name__}: {into_error}"[:800]
        return "ok", "refused"
    if into_error is not None:
        return "load-into-refused-what-load-reads", f"{type(into_error).__name__}: {into_error}"[:500]
    others = [k for k, v in loaded.items() if not isinstance(v, torch.Tensor)]
    if result.missing_keys or result.unexpected_keys != others:
        return "different-names", f"{result}; not tensors: {others}"[:500]
    wrong = [k for k, v in tensors.items() if _raw(target[k]) != _raw(v)]
    if wrong:
        return "different-data", f"tensors {wrong[:8]}"
    return "ok", "accepted"


def worker(workdir: Path, mode: str = "load") -> None:
    bases = {name: (workdir / name).read_bytes() for name in BASES}
    fallbacks = {}
    if mode == "into":
        import torch
        for name in BASES:
            fallbacks[name] = _plain_tensors(torch.load(workdir / name, weights_only=True))
        cap_memory()
    target = workdir / f"case.{os.getpid()}"
    crash_on = os.environ.get("GDSKIT_TORCH_FUZZ_CRASH_ON")  # "base:seed": the harness's own test
    for i, line in enumerate(sys.stdin):
        base, seed = json.loads(line)
        if crash_on == f"{base}:{seed}":
            os.kill(os.getpid(), signal.SIGSEGV)
        data, how = mutate(bases[base], seed)
        target.write_bytes(data)
        verdict, detail = judge(str(target)) if mode == "load" else judge_into(str(target), fallbacks[base])
        print(json.dumps({"case": i, "verdict": verdict, "detail": detail, "mutation": how}), flush=True)
    target.unlink(missing_ok=True)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), *sys.argv[2:3])
