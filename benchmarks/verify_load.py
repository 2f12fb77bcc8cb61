"""Verified against unverified loads: ``gdskit.safetensors.load_file`` of a safetensors file
(32 MiB bf16 tensors, digests in its header) into GPU memory with ``verify=False`` and
``verify=True``, hot page cache, each run in a fresh process, the two interleaved; each
process loads twice (first call, second call). Also: the kernel's own rate over the loaded
tensors, its first-use compile time, peak GPU memory, and ``gdskit digest``'s rate on the CPU
and on the GPU (``--device 0``).

    python benchmarks/verify_load.py --dir /tmp/vl --gib 4 --rounds 3 [--out result.json]

``--cold``: the page cache is dropped before each process, so its first load reads from the
disk (its second is then hot); the summary adds each round's verified-to-plain ratio of the
first loads (the two of a round run back to back, so the disk's drift falls on both alike).

``--device cpu``: the same loads into host memory (128 x 8 MiB float32 tensors per GiB, hashed
on the CPU), no kernel or ``gdskit digest`` figures; runs on a machine without a GPU. ``--reader``
picks the readers (``load_file``, ``load_into``, ``iter_tensors`` of the safetensors file;
``torch_load``, ``torch_load_into`` of a torch.save archive of the same tensors with its manifest),
``--src name=path,...`` the gdskit source trees to compare (each reader, tree and verify setting in
its own fresh process, interleaved round by round).

    python benchmarks/verify_load.py --device cpu --gib 1 --rounds 5 \
        --reader load_file,load_into,iter_tensors,torch_load,torch_load_into --src before=/tmp/old/src,after=src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fresh_process import report, run_child  # noqa: E402
from page_cache import drop_caches, warm  # noqa: E402

TENSOR_BYTES = 32 << 20
CPU_TENSOR_BYTES = 8 << 20


CPU_READERS = ("load_file", "load_into", "iter_tensors", "torch_load", "torch_load_into")


def make_cpu_files(folder: str, gib: int) -> tuple[str, str]:
    """The safetensors file (digests in its header) and the torch.save archive (a manifest beside
    it) of the same tensors; made once."""
    st_path = os.path.join(folder, f"model-cpu-{gib}g.safetensors")
    pt_path = os.path.join(folder, f"model-cpu-{gib}g.pt")
    if os.path.exists(st_path) and os.path.exists(pt_path + ".gdskit-digest.json"):
        return st_path, pt_path
    import torch

    import gdskit.safetensors as gs
    from gdskit.formats import digest_scan

    n = (gib << 30) // CPU_TENSOR_BYTES
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.weight": torch.randn(CPU_TENSOR_BYTES // 4, generator=g) for i in range(n)}
    gs.save_file(tensors, st_path, digests=True)
    torch.save(tensors, pt_path)
    digest_scan.make_manifests([pt_path])
    return st_path, pt_path


def _cpu_load(reader: str, st_path: str, pt_path: str, verify: bool, target: dict) -> None:
    import gdskit.safetensors as gs
    import gdskit.torch as gt

    if reader == "load_file":
        gs.load_file(st_path, device="cpu", verify=verify)
    elif reader == "load_into":
        gs.load_into(target, st_path, verify=verify)
    elif reader == "iter_tensors":
        for _name, t in gs.iter_tensors(st_path, device="cpu", verify=verify):
            del t
    elif reader == "torch_load":
        gt.load(pt_path, map_location="cpu", verify=verify)
    else:
        gt.load_into(target, pt_path, verify=verify)


def cpu_child(st_path: str, pt_path: str, reader: str, verify: bool) -> None:
    import torch

    import gdskit
    import gdskit.safetensors as gs

    size = os.path.getsize(st_path if reader in ("load_file", "load_into", "iter_tensors") else pt_path)
    target = {}
    if reader.endswith("load_into"):  # the model's tensors exist before the load, as in a real one
        with gs.safe_open(st_path, framework="pt") as f:
            target = {n: torch.empty(CPU_TENSOR_BYTES // 4) for n in f.keys()}
    out: dict = {"verify": verify, "reader": reader}
    for call in ("first", "second"):
        t0 = time.perf_counter()
        _cpu_load(reader, st_path, pt_path, verify, target)
        out[f"{call}_s"] = time.perf_counter() - t0
        out[f"{call}_gbps"] = size / out[f"{call}_s"] / 1e9
    out["verified"] = gdskit.stats().verified.to_dict()
    report(out)


def make_file(path: str, gib: int, device: str = "cuda:0") -> None:
    """``gib`` GiB of 32 MiB bf16 tensors with their digests in the header, made on ``device``."""
    import torch

    import gdskit.safetensors as gs

    n = max(1, (gib << 30) // TENSOR_BYTES)
    tensors = {f"layer.{i}.weight": torch.randn(TENSOR_BYTES // 2, device=device).to(torch.bfloat16)
               for i in range(n)}
    gs.save_file(tensors, path, digests=True)


def child(path: str, verify: bool) -> None:
    import torch

    import gdskit
    import gdskit.safetensors as gs
    from gdskit.engine import digest_buffers

    torch.zeros(1, device="cuda:0")  # the CUDA context, outside the timings
    size = os.path.getsize(path)
    out: dict = {"verify": verify}
    for call in ("first", "second"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        tensors = gs.load_file(path, device="cuda:0", verify=verify)
        torch.cuda.synchronize()
        out[f"{call}_s"] = time.perf_counter() - t0
        out[f"{call}_gbps"] = size / out[f"{call}_s"] / 1e9
        out[f"{call}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if call == "second":
            named = list(tensors.values())
            nbytes = sum(t.nbytes for t in named)
            stream = torch.cuda.current_stream().cuda_stream
            t0 = time.perf_counter()
            digest_buffers([(t.data_ptr(), t.nbytes) for t in named], stream, 0)  # compiled by now if verify
            out["kernel_incl_compile_s"] = time.perf_counter() - t0
            rates = []
            for _ in range(3):
                t0 = time.perf_counter()
                digest_buffers([(t.data_ptr(), t.nbytes) for t in named], stream, 0)
                rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
            out["kernel_gbps"] = max(rates)
            out["verified"] = gdskit.stats().verified.to_dict()
        del tensors
    report(out)


def cpu_main(args: argparse.Namespace) -> None:
    """Host-memory loads: every reader, source tree and verify setting in its own fresh process,
    interleaved (the order turns round each round); medians per reader, tree and setting."""
    from fresh_process import run_child_in_tree, source_trees

    os.makedirs(args.dir, exist_ok=True)
    st_path, pt_path = make_cpu_files(args.dir, args.gib)
    readers = [r for r in args.reader.split(",") if r]
    trees = source_trees(args.src)
    cases = [(r, t, v) for r in readers for t in trees for v in (False, True)]
    runs: list[dict] = []
    for rnd in range(args.rounds):
        warm([st_path, pt_path])
        for reader, tree, verify in (cases if rnd % 2 == 0 else cases[::-1]):
            res = run_child_in_tree(__file__, ["--device", "cpu", "--child", st_path, pt_path, reader,
                                               "1" if verify else "0"], trees[tree], timeout=300)
            res.update(tree=tree, reader=reader, verify=verify)
            print(json.dumps(res), flush=True)
            runs.append(res)
    summary: dict = {"device": "cpu", "file_bytes": {"safetensors": os.path.getsize(st_path),
                                                     "torch": os.path.getsize(pt_path)},
                     "rounds": args.rounds, "cpus": os.cpu_count(), "cases": {}}
    for reader, tree, verify in cases:
        mine = [r for r in runs if (r["reader"], r["tree"], r["verify"]) == (reader, tree, verify) and "error" not in r]
        if not mine:
            continue
        case = summary["cases"][f"{reader} {tree} verify={verify}"] = {}
        for key in ("first_s", "second_s", "first_gbps", "second_gbps"):
            vals = [r[key] for r in mine]
            case[key + "_median"] = round(statistics.median(vals), 3)
            case[key + "_range"] = [round(min(vals), 3), round(max(vals), 3)]
    print("SUMMARY " + json.dumps(summary, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"summary": summary, "runs": runs}, fh, indent=1)


def _blake3_library_rate(path: str) -> float:
    """The blake3 package's own rate on this machine: the file's bytes, already in memory, hashed
    once on every core (``max_threads=AUTO``); what ``gdskit digest`` on the CPU is compared with
    (it hashes each byte three times: the file's, its chunk's and its tensor's digest)."""
    import blake3

    with open(path, "rb") as fh:
        data = fh.read()
    t0 = time.perf_counter()
    blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()
    return len(data) / (time.perf_counter() - t0) / 1e9


def _pair_ratios(runs: list[dict]) -> list[float]:
    """Each round's verified first load's seconds over its plain one's."""
    out = []
    for r in sorted({run["round"] for run in runs}):
        got = {run["verify"]: run["first_s"] for run in runs if run["round"] == r and "error" not in run}
        if len(got) == 2:
            out.append(round(got[True] / got[False], 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/gdskit-verify-bench")
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each process (GPU loads)")
    ap.add_argument("--loads-only", action="store_true", help="GPU loads: skip the digest rates after the rounds")
    ap.add_argument("--reader", default="load_file", help=f"--device cpu: readers, of {', '.join(CPU_READERS)}")
    ap.add_argument("--src", default="", help="--device cpu: name=path,... gdskit source trees to compare")
    ap.add_argument("--child", nargs="+")
    args = ap.parse_args()
    if args.child:
        if args.device == "cpu":
            cpu_child(args.child[0], args.child[1], args.child[2], args.child[3] == "1")
        else:
            child(args.child[0], args.child[1] == "1")
        return
    if args.device == "cpu":
        cpu_main(args)
        return
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"model-{args.gib}g.safetensors")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        make_file(path, args.gib)
        print(f"made {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.cold:
        warm([path])
    runs: list[dict] = []
    for r in range(args.rounds):
        for verify in ((False, True) if r % 2 == 0 else (True, False)):
            if args.cold:
                drop_caches([path])
            res = run_child(__file__, ["--child", path, "1" if verify else "0"], timeout=300)
            res["round"] = r
            print(json.dumps(res), flush=True)
            runs.append(res)
    if args.loads_only:
        _summarize(args, path, runs, {})
        return
    from gdskit.formats import digest_scan

    t0 = time.perf_counter()
    digest_scan.make_manifests([path])
    cpu_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    digest_scan.make_manifests([path], device=0)
    gpu_s = time.perf_counter() - t0
    library_gbps = _blake3_library_rate(path)
    _summarize(args, path, runs, {"gdskit_digest_cpu_gbps": os.path.getsize(path) / cpu_s / 1e9,
                                  "gdskit_digest_gpu_gbps": os.path.getsize(path) / gpu_s / 1e9,
                                  "blake3_library_one_pass_gbps": library_gbps})


def _summarize(args: argparse.Namespace, path: str, runs: list[dict], rates: dict) -> None:
    summary: dict = {"file_bytes": os.path.getsize(path), "rounds": args.rounds, "cpus": os.cpu_count(),
                     "cold": args.cold,
                     "first_s_verified_over_plain_by_round": _pair_ratios(runs), **rates}
    for verify in (False, True):
        mine = [r for r in runs if r.get("verify") is verify and "error" not in r]
        for key in ("first_gbps", "second_gbps", "first_peak_gib", "second_peak_gib", "kernel_gbps"):
            if mine:
                summary[f"{'verified' if verify else 'plain'}_{key}_median"] = statistics.median(r[key] for r in mine)
                summary[f"{'verified' if verify else 'plain'}_{key}_all"] = [round(r[key], 3) for r in mine]
    print("SUMMARY " + json.dumps(summary, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"summary": summary, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
