#!/usr/bin/env python3
"""Checkpoint loaders side by side: gdskit against every peer, hot and cold page cache.

Creates two checkpoints (one large file of 32 MiB bf16 tensors, one of many small
tensors; each as safetensors and as a torch.save file), then runs every loader in
its own fresh process and times the call up to ``torch.cuda.synchronize()``.
Reports GB/s (1 GB = 1e9 bytes), CPU-seconds per GB, peak GPU memory against the
checkpoint size, and ratios against gdskit. Cold runs drop the page cache before
each run (root: ``/proc/sys/vm/drop_caches``; otherwise ``posix_fadvise(DONTNEED)``
on the files). A raw multi-threaded O_DIRECT read of the large file gives the
disk's own rate for the cold target: ``odirect`` hands 16 MiB blocks out in file order,
``odirect-ranges`` gives each thread its own contiguous run; the target uses the faster.

    python benchmarks/loaders.py --dir /data/bench --size 8 --cold --json out.json
    python benchmarks/loaders.py --save --dir /data/bench --size 8      # saving GB/s

Into existing tensors (docs/models.md): ``--files large,small,llama`` with the loaders of
``INTO_LOADERS`` and ``MODEL_LOADERS``. The ``llama`` set is a Llama-shaped checkpoint of about
``--size`` GiB in two shards with its ``config.json``; an ``*-into`` loader fills a model whose
tensors were allocated on the device before the clock started (its peak GPU memory counts them),
a ``MODEL_LOADERS`` one builds the model itself:

    python benchmarks/loaders.py --dir /data/bench --size 8 --files large,small,llama \
        --loaders gdskit,gdskit-into,safetensors-into,fastsafetensors-into,instanttensor-into,gdskit-model,transformers

Peers whose package is missing are reported as "not installed".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable

import fresh_process  # benchmarks/ is on sys.path when run as a script
from page_cache import drop_caches, warm
from raw_disk import odirect_io

GB = 1e9
MiB = 1 << 20

LOADERS = ["gdskit", "gdskit-torch", "safetensors", "fastsafetensors-nogds", "fastsafetensors-gds",
           "runai", "kvikio", "torch-mmap", "odirect", "odirect-ranges"]
SAVERS = ["gdskit", "gdskit-torch", "safetensors", "torch"]
PACKAGE = {"gdskit": "gdskit", "gdskit-torch": "gdskit", "safetensors": "safetensors",
           "fastsafetensors-nogds": "fastsafetensors", "fastsafetensors-gds": "fastsafetensors",
           "runai": "runai_model_streamer", "kvikio": "kvikio", "torch-mmap": "torch", "odirect": "os",
           "odirect-ranges": "os",
           "torch": "torch"}
TORCH_FORMAT = {"gdskit-torch", "torch-mmap"}
#: Fill a model that exists (its tensors allocated before the clock): gdskit.safetensors.load_into
#: against what users do today (safetensors.torch.load_file + Module.load_state_dict; fastsafetensors
#: or InstantTensor's zero-copy buffers, then copy_ into the parameters).
INTO_LOADERS = ["gdskit-into", "gdskit-into-ring", "safetensors-into", "fastsafetensors-into", "instanttensor-into"]
#: Build a transformers model and fill it (the llama set only): gdskit.transformers.load_model
#: against from_pretrained(...).to(device).
MODEL_LOADERS = ["gdskit-model", "gdskit-model-late", "transformers"]
PACKAGE.update({"gdskit-into": "gdskit", "gdskit-into-ring": "gdskit", "safetensors-into": "safetensors", "fastsafetensors-into": "fastsafetensors",
                "instanttensor-into": "instanttensor", "gdskit-model": "transformers",
                "gdskit-model-late": "transformers", "transformers": "transformers"})


# -- checkpoint creation ----------------------------------------------------------

def _random_bf16(rng, n: int):
    """``n`` bf16 values of random bits, made on the GPU where there is one (CPU generators take minutes
    for 8 GiB), else with numpy's generator."""
    import torch
    if n == 0:
        return torch.empty(0, dtype=torch.bfloat16)
    if torch.cuda.is_available():
        seed = int(rng.integers(0, 2**62))
        g = torch.Generator(device="cuda").manual_seed(seed)
        bits = torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, device="cuda", generator=g)
        return bits.cpu().view(torch.bfloat16)
    return torch.frombuffer(bytearray(rng.bytes(2 * n)), dtype=torch.bfloat16)


def _tensor_set(kind: str, size_gib: float, small_count: int, small_avg_kib: int):
    import numpy as np
    rng = np.random.default_rng(0)
    out = {}
    if kind == "large":
        n = max(1, int(size_gib * 1024 * MiB) // (32 * MiB))
        for i in range(n):
            out[f"layers.{i}.weight"] = _random_bf16(rng, 16 * MiB)
    else:
        avg = small_avg_kib * 1024 // 2  # elements of 2 bytes
        sizes = rng.integers(avg // 5, avg * 9 // 5, small_count).tolist()
        for i, n in enumerate(sizes):
            out[f"blocks.{i}.param"] = _random_bf16(rng, n)
    return out


def ensure_files(directory: str, size_gib: float, small_count: int, small_avg_kib: int) -> dict[str, dict[str, str]]:
    """Create the checkpoints once; later runs reuse them."""
    os.makedirs(directory, exist_ok=True)
    files: dict[str, dict[str, str]] = {}
    for kind in ("large", "small"):
        st = os.path.join(directory, f"{kind}.safetensors")
        pt = os.path.join(directory, f"{kind}.pt")
        if not (os.path.exists(st) and os.path.exists(pt)):
            import gdskit.safetensors
            import gdskit.torch
            print(f"creating {kind} checkpoint in {directory} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            tensors = _tensor_set(kind, size_gib, small_count, small_avg_kib)
            t1 = time.perf_counter()
            gdskit.safetensors.save_file(tensors, st)
            t2 = time.perf_counter()
            gdskit.torch.save(tensors, pt)
            print(f"  made in {t1 - t0:.1f} s, safetensors saved in {t2 - t1:.1f} s, torch.save file in "
                  f"{time.perf_counter() - t2:.1f} s", file=sys.stderr, flush=True)
            del tensors
        files[kind] = {"safetensors": st, "torch": pt}
    return files


def llama_shape(size_gib: float) -> dict:
    """A Llama config of about ``size_gib`` GiB in bf16: Llama-3-8B's widths from 4 GiB up (as many
    layers as fit), narrower ones below so that a small run stays small."""
    if size_gib >= 4:
        dims = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 128256}
    elif size_gib >= 0.5:
        dims = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                "num_key_value_heads": 4, "vocab_size": 32000}
    else:
        dims = {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 4000}
    h, inter, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    kv = h // dims["num_attention_heads"] * dims["num_key_value_heads"]
    per_layer = 2 * (2 * h * h + 2 * kv * h + 3 * h * inter + 2 * h)
    fixed = 2 * (2 * v * h + h)
    layers = max(2, round((size_gib * 1024**3 - fixed) / per_layer))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **dims, "num_hidden_layers": layers,
            "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "dtype": "bfloat16", "torch_dtype": "bfloat16"}


def llama_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """The names and shapes of a LlamaForCausalLM state dict, in the model's order."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def ensure_llama(directory: str, size_gib: float) -> str:
    """A Llama-shaped checkpoint in two shards, as save_pretrained lays it out (config.json, the
    shards, model.safetensors.index.json), random bf16 values; made once."""
    import numpy as np
    out = os.path.join(directory, "llama")
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        return out
    import gdskit.safetensors
    print(f"creating llama checkpoint in {out} ...", file=sys.stderr, flush=True)
    os.makedirs(out, exist_ok=True)
    config = llama_shape(size_gib)
    shapes = llama_tensors(config)
    total = sum(2 * int(np.prod(s)) for s in shapes.values())
    rng = np.random.default_rng(1)
    shards: list[list[str]] = [[], []]
    seen = 0
    for name, shape in shapes.items():
        shards[0 if seen < total / 2 else 1].append(name)
        seen += 2 * int(np.prod(shape))
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: _random_bf16(rng, int(np.prod(shapes[n]))).reshape(shapes[n]) for n in names}
        gdskit.safetensors.save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        del tensors
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    with open(index, "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return out


def _shard_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    return [path]


def _payload_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in _shard_files(path))


# -- the loaders (run inside the child process) -------------------------------------

_MODULES = {"gdskit": "gdskit.safetensors", "gdskit-torch": "gdskit.torch", "safetensors": "safetensors.torch",
            "fastsafetensors-nogds": "fastsafetensors", "fastsafetensors-gds": "fastsafetensors",
            "runai": "runai_model_streamer", "kvikio": "kvikio", "torch": "torch", "torch-mmap": "torch"}


_MODULES.update({"gdskit-into": "gdskit.safetensors", "gdskit-into-ring": "gdskit.safetensors", "safetensors-into": "safetensors.torch",
                 "fastsafetensors-into": "fastsafetensors", "instanttensor-into": "instanttensor",
                 "gdskit-model": "transformers", "gdskit-model-late": "transformers", "transformers": "transformers"})


def _import_loader(loader: str) -> None:
    import importlib
    if loader in _MODULES:
        importlib.import_module(_MODULES[loader])
    if loader in ("gdskit-model", "gdskit-model-late"):
        importlib.import_module("gdskit.transformers")
    if loader == "gdskit-model-late":  # the engine set up only when load_into reads (as before)
        sys.modules["gdskit.transformers"].EARLY_WARM_UP = False
    if loader in ("gdskit-into", "gdskit-into-ring", "gdskit-model", "gdskit-model-late"):  # what their first call imports
        importlib.import_module("gdskit.formats.into_exec")
    if loader == "gdskit-into-ring":  # runs of small tensors through a staging ring on the GPU
        sys.modules["gdskit.formats.into_exec"].GPU_SMALL_READS = "ring"


def _import_model_class(path: str) -> None:
    """transformers imports a model's modules when its class is first looked up (seconds for
    Llama's); a program has them before it loads weights, as the model loaders do here."""
    import transformers
    with open(os.path.join(path, "config.json")) as fh:
        for arch in json.load(fh).get("architectures", []):
            getattr(transformers, arch, None)
    transformers.AutoModelForCausalLM  # noqa: B018 - the lookup imports it


def _instrument_gdskit() -> dict:
    """Where a gdskit load's time goes (``--breakdown``): seconds in header parsing, in
    allocating destination tensors, in submitting reads, in the whole read phase, in waiting
    for the engine's jobs (the main thread's waits), and in setting the engine up (the pinned
    ring and the direct-route facts, made in the background while the destinations are
    allocated; zero once a process has them). Loads into existing tensors also say what comes
    before the reads: gathering the target's tensors, describing them, indexing the
    checkpoint (its headers included), pairing and checking, and after them: the version
    counters; ``fills_s`` is the whole read phase of such a load."""
    import concurrent.futures
    import threading

    import torch

    import gdskit
    import gdskit.engine.direct_path
    import gdskit.safetensors
    from gdskit.engine import pool
    from gdskit.formats import into_exec, safetensors_format, shard_index, torch_io

    t = {"header_s": 0.0, "alloc_s": 0.0, "allocs": 0, "submit_s": 0.0, "reads": 0, "execute_s": 0.0,
         "wait_s": 0.0, "ring_s": 0.0, "route_s": 0.0}

    def timed(fn, key, count=None, main_only=False):
        main = threading.main_thread()

        def wrapper(*a, **k):
            if main_only and threading.current_thread() is not main:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t[key] = t.get(key, 0.0) + time.perf_counter() - t0
                if count:
                    t[count] += 1
        return wrapper

    class _TorchProxy:  # torch as torch_io sees it, with empty() timed
        def __getattr__(self, name):
            return getattr(torch, name)
    proxy = _TorchProxy()
    proxy.empty = timed(torch.empty, "alloc_s", "allocs")
    torch_io.torch = proxy
    safetensors_format.read_header_file = timed(safetensors_format.read_header_file, "header_s")
    torch_io.execute = timed(torch_io.execute, "execute_s")
    gdskit.File.pread = timed(gdskit.File.pread, "submit_s", "reads")  # small-tensor groups
    gdskit.File.pread_many = timed(gdskit.File.pread_many, "submit_s", "reads")  # batches of large tensors
    concurrent.futures.Future.result = timed(concurrent.futures.Future.result, "wait_s", main_only=True)
    pool.prepare = timed(pool.prepare, "ring_s")
    route = timed(gdskit.engine.direct_path.direct_route, "route_s")  # once a process; cached after
    gdskit.engine.direct_path.direct_route = read_route.direct_route = route
    # Into existing tensors: the checks before the first read, the reads, the version counters.
    shard_index.index_checkpoint = timed(shard_index.index_checkpoint, "index_s")
    for name, key in (("target_tensors", "targets_s"), ("describe", "describe_s"), ("plan_into", "pair_s"),
                      ("run_fills", "fills_s"), ("execute", "execute_s"), ("_mark_modified", "versions_s")):
        setattr(into_exec, name, timed(getattr(into_exec, name), key))
    if "gdskit.transformers" in sys.modules:  # load_model: what it does around load_into
        import transformers

        import gdskit.transformers as gtr
        gtr._build_on_meta = timed(gtr._build_on_meta, "build_s")
        gdskit.safetensors.load_into = timed(gdskit.safetensors.load_into, "load_into_s")
        torch.nn.Module.to_empty = timed(torch.nn.Module.to_empty, "to_empty_s")
        transformers.AutoConfig.from_pretrained = timed(transformers.AutoConfig.from_pretrained, "config_s")
        for name in ("tie_weights", "initialize_weights", "eval"):
            if hasattr(transformers.PreTrainedModel, name):
                setattr(transformers.PreTrainedModel, name,
                        timed(getattr(transformers.PreTrainedModel, name), f"{name}_s"))
    return t


def _prepare(loader: str, path: str, device: str):
    """What an ``*-into`` loader fills, made before the clock starts: a module whose parameters
    are the checkpoint's tensors, allocated (not initialised) on ``device``."""
    if loader not in INTO_LOADERS:
        return None
    import torch

    import gdskit.safetensors as gs
    from gdskit.formats.shard_index import index_checkpoint

    root = torch.nn.Module()
    for name, loc in index_checkpoint(path).tensors.items():
        dtype, shape = gs._torch_type(torch, loc.entry)
        *parents, leaf = name.split(".")
        module = root
        for part in parents:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                           requires_grad=False))
    # A program builds its model without gdskit parsing the checkpoint's headers: the load must
    # not find them remembered (a 20,000-tensor header is tens of milliseconds to parse).
    from gdskit.formats.safetensors_format import forget_headers
    forget_headers()
    return root


def _load_into(loader: str, target, path: str, device: str, threads: int):
    import torch
    if loader in ("gdskit-into", "gdskit-into-ring"):
        import gdskit.safetensors
        return gdskit.safetensors.load_into(target, path, progress=False)
    files = _shard_files(path)
    if loader == "safetensors-into":
        from safetensors.torch import load_file
        state = {}
        for f in files:
            state.update(load_file(f, device=device))
        return target.load_state_dict(state)
    params = dict(target.named_parameters())
    if loader == "fastsafetensors-into":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        try:
            fl = SafeTensorsFileLoader(SingleGroup(), torch.device(device), max_threads=threads, nogds=True)
        except TypeError:
            fl = SafeTensorsFileLoader(SingleGroup(), torch.device(device), nogds=True)
        fl.add_filenames({0: files})
        fb = fl.copy_files_to_device()
        for name in fl.get_keys():
            params[name].copy_(fb.get_tensor(name))
        torch.cuda.synchronize()
        return (fb, fl)  # kept alive until the clock stops, as for the plain fastsafetensors loader
    if loader == "instanttensor-into":
        from instanttensor import safe_open
        index = torch.device(device).index or 0
        try:
            opened = safe_open(files, framework="pt", device=index, copy=False)
        except TypeError:  # releases before the copy argument hand out their buffers anyway
            opened = safe_open(files, framework="pt", device=index)
        with opened as f:
            for name, t in f.tensors():
                params[name].copy_(t)  # the buffer is reused: copied before the next tensor
        return None
    raise SystemExit(f"unknown loader {loader}")


def _load(loader: str, path: str, device: str, threads: int, target=None):
    import torch
    if loader in INTO_LOADERS:
        return _load_into(loader, target, path, device, threads)
    if loader in ("gdskit-model", "gdskit-model-late"):
        import gdskit.transformers
        return gdskit.transformers.load_model(path, device=device)
    if loader == "transformers":
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path).to(device)
    if loader == "gdskit":
        import gdskit.safetensors
        return gdskit.safetensors.load_file(path, device=device, progress=False)
    if loader == "gdskit-torch":
        import gdskit.torch
        return gdskit.torch.load(path, map_location=device, progress=False)
    if loader == "safetensors":
        from safetensors.torch import load_file
        return load_file(path, device=device)
    if loader.startswith("fastsafetensors"):
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        kw = {"nogds": loader.endswith("nogds")}
        try:
            fl = SafeTensorsFileLoader(SingleGroup(), torch.device(device), max_threads=threads, **kw)
        except TypeError:
            fl = SafeTensorsFileLoader(SingleGroup(), torch.device(device), **kw)
        fl.add_filenames({0: [path]})
        fb = fl.copy_files_to_device()
        out = {k: fb.get_tensor(k) for k in fl.get_keys()} if hasattr(fl, "get_keys") else {}
        torch.cuda.synchronize()
        return (out, fb, fl)  # kept alive until the clock stops
    if loader == "runai":
        from runai_model_streamer import SafetensorsStreamer
        out = {}
        with SafetensorsStreamer() as s:
            s.stream_file(path)
            for name, t in s.get_tensors():
                out[name] = t.to(device)
        return out
    if loader == "kvikio":
        import kvikio
        buf = torch.empty(os.path.getsize(path), dtype=torch.uint8, device=device)
        with kvikio.CuFile(path, "r") as f:
            f.read(buf)
        return buf
    if loader == "torch-mmap":
        return torch.load(path, mmap=True, map_location=device, weights_only=True)
    if loader in ("odirect", "odirect-ranges"):
        return odirect_read(path, threads, ranges=loader == "odirect-ranges")
    raise SystemExit(f"unknown loader {loader}")


def odirect_read(path: str, threads: int, block: int = 16 * MiB, *, ranges: bool = False) -> int:
    """Read the whole file with O_DIRECT, ``threads`` workers, into per-thread aligned buffers."""
    return odirect_io([path], threads, block, ranges=ranges).bytes


def child(args: argparse.Namespace) -> None:
    """One load (or save) in a fresh process; prints one JSON line."""
    if args.loader == "kvikio":
        os.environ.setdefault("KVIKIO_NTHREADS", str(args.threads))
        # KvikIO's own POSIX path is its fastest where cuFile can only run in compat mode.
        os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    if args.loader == "runai":
        os.environ.setdefault("RUNAI_STREAMER_CONCURRENCY", str(args.threads))
    if args.loader.startswith("gdskit"):
        os.environ.setdefault("GDSKIT_THREADS", str(args.threads))
    import torch
    use_cuda = args.device.startswith("cuda") and not args.loader.startswith("odirect")
    if use_cuda:
        torch.cuda.init()
        torch.empty(1, device=args.device)  # CUDA context outside the clock, for every loader alike
        torch.cuda.reset_peak_memory_stats()
    _import_loader(args.loader)  # a program imports its libraries once; the clock times the load
    if args.loader in MODEL_LOADERS:
        _import_model_class(args.path)
    base = torch.cuda.memory_allocated() if use_cuda else 0
    target = None if args.save else _prepare(args.loader, args.path, args.device)  # counted in the peak
    # After the target is made: its header read is not the load's.
    timings = _instrument_gdskit() if args.breakdown and args.loader.startswith("gdskit") else None
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if args.save:
        nbytes = _save(args)
    else:
        result = _load(args.loader, args.path, args.device, args.threads, target)
        if use_cuda:
            torch.cuda.synchronize()
        nbytes = _payload_bytes(args.path)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    peak = (torch.cuda.max_memory_allocated() - base) if use_cuda else 0
    out = {"loader": args.loader, "wall_s": wall, "cpu_s": cpu, "bytes": nbytes, "peak_gpu_bytes": peak}
    if timings is not None:
        out["breakdown"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in timings.items()}
    if args.loader.startswith("gdskit"):
        import gdskit
        try:
            out["pinned_bytes"] = gdskit.resources().pinned_bytes
            out["pinned_budget"] = gdskit.settings.pinned_budget
        except AttributeError:
            pass
        # Which path the bytes took (a fresh process: the whole ledger is this load's).
        moved = {name: p.bytes_written if args.save else p.bytes_read for name, p in gdskit.stats().paths.items()}
        out["paths"] = {name: n for name, n in moved.items() if n}
        # Whether the pinned ring got its 2 MiB pages: the process's anonymous huge pages
        # (the ring is most of them), for telling a slow machine from a fast one.
        from gdskit.bench.memory import anon_huge_bytes
        out["anon_huge_bytes"] = anon_huge_bytes()
    if not args.save:
        del result, target
    fresh_process.report(out)


def _save(args: argparse.Namespace) -> int:
    import torch
    tensors = getattr(args, "_tensors")
    target = args.path
    if args.loader == "gdskit":
        import gdskit.safetensors
        gdskit.safetensors.save_file(tensors, target)
    elif args.loader == "gdskit-torch":
        import gdskit.torch
        gdskit.torch.save(tensors, target)
    elif args.loader == "safetensors":
        from safetensors.torch import save_file
        save_file(tensors, target)
        _fsync(target)
    elif args.loader == "torch":
        torch.save(tensors, target)
        _fsync(target)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_child(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file
    tensors = load_file(args.source, device=args.device)  # the set, already on the GPU
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    args._tensors = tensors
    child(args)


# -- the parent -------------------------------------------------------------------

def installed(loader: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(PACKAGE[loader]) is not None


def run_child(argv: list[str], timeout: float) -> dict:
    return fresh_process.run_child(__file__, argv, timeout)


def summarize(r: dict) -> dict:
    if "error" in r:
        return r
    r["gb_per_s"] = r["bytes"] / GB / r["wall_s"]
    r["cpu_s_per_gb"] = r["cpu_s"] / (r["bytes"] / GB)
    r["peak_gpu_ratio"] = r["peak_gpu_bytes"] / r["bytes"] if r["bytes"] else 0.0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/gdskit-bench", help="where the checkpoints live (created once)")
    ap.add_argument("--size", type=float, default=8.0, help="GiB of the large checkpoint")
    ap.add_argument("--small-count", type=int, default=20000)
    ap.add_argument("--small-avg-kib", type=int, default=100)
    ap.add_argument("--loaders", default=",".join(LOADERS),
                    help="comma list from: " + ", ".join(LOADERS + INTO_LOADERS + MODEL_LOADERS))
    ap.add_argument("--files", default="large,small", help="comma list from: large, small, llama")
    ap.add_argument("--cold", action="store_true", help="also run with the page cache dropped before each run")
    ap.add_argument("--no-hot", action="store_true", help="skip the hot runs")
    ap.add_argument("--repeats", type=int, default=1, help="runs per loader and mode (best is reported)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every loader this many times, in alternating order; medians are reported, "
                         "with each round's range and how many rounds gdskit won against the best peer")
    ap.add_argument("--threads", type=int, default=16, help="I/O threads for loaders that take a count")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--save", action="store_true", help="benchmark saving the large set from GPU instead")
    ap.add_argument("--breakdown", action="store_true",
                    help="gdskit loaders also report seconds in header parsing, allocation, read submission, "
                         "the read phase, and the engine's set-up (pinned ring, direct route)")
    ap.add_argument("--json", dest="json_out", help="write all results here")
    # child-process arguments
    ap.add_argument("--child", dest="loader", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.loader:
        (save_child if args.save else child)(args)
        return

    files = ensure_files(args.dir, args.size, args.small_count, args.small_avg_kib)
    if "llama" in args.files.split(","):
        llama = ensure_llama(args.dir, args.size)
        files["llama"] = {"safetensors": llama, "torch": llama}
    common = ["--device", args.device, "--threads", str(args.threads)] + (["--breakdown"] if args.breakdown else [])
    if args.save:
        names = args.loaders.split(",") if args.loaders != ",".join(LOADERS) else SAVERS
        rounds = _rounds(args, names, lambda order, i: _save_round(args, files, order, common, i))
    else:
        modes = ([] if args.no_hot else ["hot"]) + (["cold"] if args.cold else [])
        names = args.loaders.split(",")
        rounds = _rounds(args, names, lambda order, i: _one_round(args, files, order, modes, common, i))
    rows = combine(rounds, names)
    report(rows, args)
    raise SystemExit(fresh_process.exit_status(rows))


def _rounds(args: argparse.Namespace, names: list[str],
            one_round: Callable[[list[str], int], list[dict]]) -> list[list[dict]]:
    """``--rounds`` rounds, alternating the order of ``names``: none always runs first after the
    files were made, or last after the others have churned the page cache."""
    return [one_round(names if i % 2 == 0 else names[::-1], i) for i in range(args.rounds)]


def _best_of(args: argparse.Namespace, run: Callable[[], dict]) -> dict:
    """The fastest of ``--repeats`` runs (a failed run counts as 0 GB/s)."""
    best: dict | None = None
    for _ in range(args.repeats):
        r = run()
        if best is None or r.get("gb_per_s", 0) > best.get("gb_per_s", 0):
            best = r
    assert best is not None
    return best


def _landed(index: int, what: str, best: dict) -> None:
    """One line as each result lands, so a run cut short still says what it measured."""
    print(f"# round {index + 1} {what}: {best.get('gb_per_s', best.get('error'))} GB/s"
          + (f" {best['breakdown']}" if "breakdown" in best else ""), file=sys.stderr, flush=True)


def _save_round(args: argparse.Namespace, files: dict, savers: list[str], common: list[str],
                index: int) -> list[dict]:
    """Every saver once (the best of ``--repeats`` runs) writing the large set from device memory."""
    results = []
    for saver in savers:
        if not installed(saver):
            results.append({"loader": saver, "mode": "save", "file": "large", "error": "not installed"})
            continue
        ext = "pt" if saver in ("torch", "gdskit-torch") else "safetensors"
        out = os.path.join(args.dir, f"saved-{saver}.{ext}")

        def save_once() -> dict:
            try:
                return summarize(run_child(["--child", saver, "--save", "--path", out,
                                            "--source", files["large"]["safetensors"], *common], args.timeout))
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(out)
        best = _best_of(args, save_once)
        results.append({**best, "loader": saver, "mode": "save", "file": "large", "round": index})
        _landed(index, f"{saver} save", best)
    return results


def _one_round(args: argparse.Namespace, files: dict, loaders: list[str], modes: list[str],
               common: list[str], index: int) -> list[dict]:
    """Every loader on every file and mode once (the best of ``--repeats`` runs), each in a fresh process."""
    results = []
    all_paths = sorted({s for f in files.values() for p in f.values() for s in _shard_files(p)})
    for kind in args.files.split(","):
        for loader in loaders:
            path = files[kind]["torch" if loader in TORCH_FORMAT else "safetensors"]
            if not runs_on(loader, kind):
                continue
            for mode in modes:
                if not installed(loader):
                    results.append({"loader": loader, "file": kind, "mode": mode, "error": "not installed"})
                    continue

                def load_once() -> dict:
                    how = drop_caches(all_paths) if mode == "cold" else (warm(_shard_files(path)) or "warmed")
                    return {**summarize(run_child(["--child", loader, "--path", path, *common], args.timeout)),
                            "cache": how}
                best = _best_of(args, load_once)
                results.append({**best, "loader": loader, "file": kind, "mode": mode, "round": index})
                _landed(index, f"{loader} {kind} {mode}", best)
    return results


def runs_on(loader: str, kind: str) -> bool:
    """Whether ``loader`` is run on set ``kind``: the raw disk reads on the large file only, the
    model builders on the llama set only, and on the llama set (a directory of shards) only the
    loaders that read sharded checkpoints."""
    if loader.startswith("odirect"):
        return kind == "large"
    if loader in MODEL_LOADERS:
        return kind == "llama"
    if kind == "llama":
        return loader == "gdskit" or loader in INTO_LOADERS
    return True


def combine(rounds: list[list[dict]], loaders: list[str]) -> list[dict]:
    """One record per loader, file and mode: the median run, whole (for an even count the lower
    of the two middle ones, so that every figure comes from the same run), with every round's
    GB/s (None where a round failed) under ``rounds``."""
    groups: dict[tuple, list[dict]] = {}
    for results in rounds:
        for r in results:
            groups.setdefault((r["file"], r["mode"], r["loader"]), []).append(r)
    out = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], loaders.index(k[2]) if k[2] in loaders else 0)):
        runs = groups[key]
        ok = sorted((r for r in runs if "gb_per_s" in r), key=lambda r: r["gb_per_s"])
        if not ok:
            out.append(runs[0])
            continue
        by_round = [None] * len(rounds)
        for r in runs:
            by_round[r["round"]] = r.get("gb_per_s")
        out.append({**ok[(len(ok) - 1) // 2], "rounds": by_round})
    return out


def report(results: list[dict], args: argparse.Namespace) -> None:
    ref = {(r["file"], r["mode"]): r for r in results if r["loader"] == "gdskit" and "gb_per_s" in r}
    several = args.rounds > 1
    lines = [f"{'loader':24} {'file':6} {'mode':5} {'GB/s':>7} " + (f"{'range':>11} " if several else "")
             + f"{'vs gdskit':>9} {'CPU-s/GB':>9} {'peak GPU/size':>13}  note"]
    for r in results:
        if "gb_per_s" not in r:
            lines.append(f"{r['loader']:24} {r.get('file', ''):6} {r['mode']:5} {'-':>7} "
                         + (f"{'-':>11} " if several else "") + f"{'-':>9} {'-':>9} {'-':>13}  {r.get('error', '')}")
            continue
        g = ref.get((r["file"], r["mode"]))
        ratio = f"{r['gb_per_s'] / g['gb_per_s']:.2f}x" if g else "-"
        note = ""
        if "pinned_bytes" in r:
            note = f"pinned {r['pinned_bytes'] / MiB:.0f} MiB of {r['pinned_budget'] / MiB:.0f} MiB"
            if r.get("anon_huge_bytes") is not None:
                note += f" (process huge pages {r['anon_huge_bytes'] / MiB:.0f} MiB)"
        if r.get("paths"):
            total = sum(r["paths"].values())
            note += (", " if note else "") + " ".join(
                f"{name} {n / total:.0%}" for name, n in sorted(r["paths"].items(), key=lambda kv: -kv[1]))
        spread = ""
        if several:
            seen = [x for x in r.get("rounds", []) if x is not None]
            spread = f"{min(seen):5.2f}-{max(seen):5.2f} " if seen else f"{'-':>11} "
        lines.append(f"{r['loader']:24} {r['file']:6} {r['mode']:5} {r['gb_per_s']:7.2f} {spread}{ratio:>9} "
                     f"{r['cpu_s_per_gb']:9.3f} {r['peak_gpu_ratio']:13.3f}  {note}")
    targets = evaluate(results)
    facts = machine_facts(args.dir)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    print("\n".join(lines))
    for k, v in targets.items():
        print(f"target {k}: {v}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                       "machine": facts, "results": results, "targets": targets}, fh, indent=2)


def machine_facts(directory: str) -> dict[str, str]:
    """What differs between machines of one kind and moves hot rates: CPU model, cores, NUMA
    nodes, transparent huge pages, kernel, memory, and the filesystem the checkpoints are on
    (``gdskit bench``'s facts)."""
    from gdskit.bench.machine import collect
    from gdskit.bench.memory import transparent_huge_pages
    from gdskit.settings import format_size

    m = collect(directory, gpu_index=None)
    node_dir = "/sys/devices/system/node"
    nodes = [d for d in os.listdir(node_dir) if d.startswith("node")] if os.path.isdir(node_dir) else []
    facts = {"cpu": m.cpu_model, "cores": m.cpu_count, "numa nodes": len(nodes) or None,
             "thp": transparent_huge_pages(), "kernel": m.kernel,
             "memory": format_size(m.memory_bytes) if m.memory_bytes else None,
             "filesystem": f"{m.filesystem} on {m.mount_source}" if m.filesystem else None}
    return {k: str(v) for k, v in facts.items() if v is not None}


def evaluate(results: list[dict]) -> dict[str, str]:
    """The issue's targets, checked against this run's numbers."""
    def find(loader: str, file: str, mode: str) -> dict | None:
        for r in results:
            if r["loader"] == loader and r.get("file") == file and r["mode"] == mode and "gb_per_s" in r:
                return r
        return None

    def rate(loader: str, file: str, mode: str) -> float | None:
        r = find(loader, file, mode)
        return r["gb_per_s"] if r else None

    def rounds_ahead(peer: str, mode: str) -> str:
        """In how many rounds gdskit beat ``peer`` (each round's runs side by side)."""
        ours, theirs = find("gdskit", "large", mode), find(peer, "large", mode)
        pairs = [(a, b) for a, b in zip(ours.get("rounds", []), theirs.get("rounds", []))
                 if a is not None and b is not None]
        if len(pairs) < 2:
            return ""
        return f"; gdskit ahead in {sum(a > b for a, b in pairs)} of {len(pairs)} rounds"

    out: dict[str, str] = {}
    # Every other loader the issue names is a peer, KvikIO's raw read included; odirect is the disk.
    peers = [name for name in LOADERS if name not in ("gdskit", "gdskit-torch", "odirect", "odirect-ranges")]
    for mode in ("hot", "cold"):
        g = rate("gdskit", "large", mode)
        if g is None:
            continue
        measured = {p: x for p in peers if (x := rate(p, "large", mode)) is not None}
        if measured:
            best = max(measured, key=measured.get)
            out[f"{mode} faster than every peer"] = (f"{'met' if g > measured[best] else 'NOT met'} "
                                                     f"(gdskit {g:.2f}, best peer {best} {measured[best]:.2f} GB/s"
                                                     f"{rounds_ahead(best, mode)})")
        else:
            out[f"{mode} faster than every peer"] = "not measured (no peer ran)"
        if mode == "hot":
            out["hot >= 45 GB/s"] = f"{'met' if g >= 45 else 'NOT met'} ({g:.2f} GB/s)"
        # The disk's rate: the better of its two read orders, where both ran.
        raws = {r: x for r in ("odirect", "odirect-ranges") if (x := rate(r, "large", "cold"))}
        if mode == "cold" and raws:
            ref = max(raws, key=raws.get)
            raw = raws[ref]
            out["cold >= 0.97x raw O_DIRECT"] = (f"{'met' if g >= 0.97 * raw else 'NOT met'} "
                                                 f"({g / raw:.3f}x of {ref} {raw:.2f} GB/s)")
        s = rate("gdskit", "small", mode)
        if s is not None:
            out[f"{mode} small >= 0.8x large"] = f"{'met' if s >= 0.8 * g else 'NOT met'} ({s / g:.2f}x)"
    out.update(evaluate_into(rate, find))
    peaks = [r["peak_gpu_ratio"] for r in results if r["loader"].startswith("gdskit") and "peak_gpu_ratio" in r
             and r["mode"] != "save"]
    if peaks:
        out["peak GPU <= 1.05x"] = f"{'met' if max(peaks) <= 1.05 else 'NOT met'} (worst {max(peaks):.3f}x)"
    return out


def evaluate_into(rate: Callable[[str, str, str], float | None], find: Callable[[str, str, str], dict | None]
                  ) -> dict[str, str]:
    """The targets of loading into existing tensors (docs/models.md), where their rows ran."""
    out: dict[str, str] = {}
    large = rate("gdskit-into", "large", "hot") or rate("gdskit", "large", "hot")
    for loader, label in (("gdskit-into", ""), ("gdskit-into-ring", " (ring)")):
        small = rate(loader, "small", "hot")
        if small is not None and large:
            out[f"hot small load_into{label} >= 0.5x large"] = (f"{'met' if small >= 0.5 * large else 'NOT met'} "
                                                                 f"({small / large:.2f}x)")
    for kind in ("large", "llama"):
        for mode in ("hot", "cold"):
            ours, plain = rate("gdskit-into", kind, mode), rate("gdskit", kind, mode)
            if ours is not None and plain:
                out[f"{mode} {kind} load_into within 5% of load_file"] = (
                    f"{'met' if ours >= 0.95 * plain else 'NOT met'} ({ours / plain:.3f}x)")
    ours, theirs = rate("gdskit-model", "llama", "hot"), rate("transformers", "llama", "hot")
    if ours is not None and theirs:
        out["hot load_model >= 5x from_pretrained().to()"] = (f"{'met' if ours >= 5 * theirs else 'NOT met'} "
                                                             f"({ours / theirs:.1f}x)")
    model = find("gdskit-model", "llama", "hot")
    if model is not None and model.get("peak_gpu_bytes"):
        out["load_model peak GPU <= 1.01x model"] = (f"{'met' if model['peak_gpu_ratio'] <= 1.01 else 'NOT met'} "
                                                     f"({model['peak_gpu_ratio']:.3f}x)")
    return out


if __name__ == "__main__":
    main()
