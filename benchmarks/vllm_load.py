#!/usr/bin/env python3
"""vLLM engines' time to ready with ``load_format="gdskit"`` against vLLM's own loaders, in fresh engines.

Makes the Llama-shaped checkpoint of ``benchmarks/loaders.py`` (about ``--size`` GiB in two
shards), then starts one vLLM engine per load format, round and page-cache mode, each in its
own process, the formats' order alternating from round to round. Each engine reports two
figures:

- ``load_s``: vLLM's own "Model loading took ... seconds" (the model built on the GPU and its
  weights loaded, by whichever loader), read from the engine's log;
- ``ready_s``: the wall time from calling ``LLM(...)`` (vLLM already imported) to the first
  generated token of a one-token request: what a user waits for.

Formats: ``safetensors``, ``runai_streamer`` (vLLM's own; needs ``runai-model-streamer``),
``gdskit`` (the placement plan on: ``model_loader_extra_config={"placement": True}``) and
``gdskit-noplacement`` (every tensor through the model's ``load_weights``, the default).
Any other vLLM load format may be named too (``fastsafetensors``). For gdskit the engine's
worker also reports how many tensors the plan placed.

``hot``: the checkpoint read once before each engine; ``cold``: the page cache dropped
before each engine (root: /proc/sys/vm/drop_caches; else fadvise per file).

    python benchmarks/vllm_load.py --dir /data/bench --size 8 --rounds 3
    python benchmarks/vllm_load.py --dir /data/bench --cold --json out.json \\
        --formats safetensors,runai_streamer,gdskit,gdskit-noplacement
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from fresh_process import exit_status  # benchmarks/ is on sys.path when run as a script

_LOADING = re.compile(r"Model loading took ([0-9.]+) GiB(?: memory)? and ([0-9.]+) seconds")
#: The line a child engine prints with its own figures (JSON after the marker).
_MARKER = "VLLM_LOAD_BENCH "
#: Each format's vLLM ``load_format`` and ``model_loader_extra_config``.
FORMATS: dict[str, tuple[str, dict | None]] = {
    "safetensors": ("safetensors", None),
    "runai_streamer": ("runai_streamer", None),
    "gdskit": ("gdskit", {"placement": True}),
    "gdskit-noplacement": ("gdskit", None),
}
DEFAULT_FORMATS = "safetensors,runai_streamer,gdskit,gdskit-noplacement"


def _placement_report(model):
    """In the engine's worker: how gdskit's loader sent the tensors (None: another loader)."""
    import dataclasses

    try:
        import gdskit.vllm
    except ImportError:
        return None
    report = gdskit.vllm.last_report()
    return None if report is None else dataclasses.asdict(report)


def engine(path: str, fmt: str) -> None:
    """Start an engine and generate one token (the child's side), as a user of vLLM's offline API does."""
    from vllm import LLM, SamplingParams

    load_format, extra = FORMATS.get(fmt, (fmt, None))
    kwargs = {"model_loader_extra_config": extra} if extra is not None else {}
    start = time.perf_counter()
    llm = LLM(model=path, load_format=load_format, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              max_num_seqs=4, gpu_memory_utilization=0.6, dtype="bfloat16", **kwargs)
    built = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                 SamplingParams(temperature=0.0, max_tokens=1, detokenize=False), use_tqdm=False)
    ready = time.perf_counter()
    report = llm.apply_model(_placement_report)[0] if load_format == "gdskit" else None
    print(_MARKER + json.dumps({"ready_s": ready - start, "engine_s": built - start, "placement": report}),
          flush=True)


def parse_engine_log(log: str, returncode: int) -> dict:
    """One engine's figures from its output: ``load_s``, ``model_gib``, ``ready_s``,
    ``engine_s``, ``placement``; or ``error`` and ``log_tail``."""
    found = _LOADING.findall(log)
    mine = [line[len(_MARKER):] for line in log.splitlines() if line.startswith(_MARKER)]
    if returncode or not found or not mine:
        missing = [what for what, ok in (("no loading time logged", found), ("no first token", mine)) if not ok]
        return {"error": f"engine exited {returncode}" + "".join(f", {m}" for m in missing),
                "log_tail": "\n".join(log.splitlines()[-30:])}
    gib, seconds = found[-1]
    out = {"load_s": float(seconds), "model_gib": float(gib)}
    out.update(json.loads(mine[-1]))
    return out


def timed_engine(path: str, fmt: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--engine", path, fmt],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, VLLM_LOGGING_LEVEL="INFO",
                                                                                VLLM_ALLOW_INSECURE_SERIALIZATION="1"))
    return parse_engine_log(proc.stdout + proc.stderr, proc.returncode)


def summarize(runs: dict[str, dict[str, list[dict]]], formats: list[str], nbytes: int) -> tuple[list[str], dict]:
    """The table's lines and the targets' verdicts from every run (``runs[mode][format]``)."""
    lines: list[str] = []
    verdicts: dict[str, str] = {}
    for mode, per_format in runs.items():
        lines.append(f"\n{mode} page cache: vLLM 'Model loading took' (load) and LLM(...) to first token (ready)")
        lines.append(f"{'load format':20s} {'load s (each round)':28s} {'median':>7s} {'GB/s':>6s} "
                     f"{'vs safetensors':>15s} {'ready s (each round)':28s} {'median':>7s}  placed/fallback")
        load_med: dict[str, float] = {}
        ready_med: dict[str, float] = {}
        for fmt in formats:
            ok = [x for x in per_format.get(fmt, []) if "load_s" in x]
            if not ok:
                errors = [x["error"] for x in per_format.get(fmt, []) if "error" in x]
                lines.append(f"{fmt:20s} failed: {errors[-1] if errors else 'not run'}")
                continue
            loads = [x["load_s"] for x in ok]
            readies = [x["ready_s"] for x in ok]
            load_med[fmt] = statistics.median(loads)
            ready_med[fmt] = statistics.median(readies)
            base = load_med.get("safetensors")
            ratio = f"{load_med[fmt] / base:.2f}x" if base else ""
            rep = ok[-1].get("placement")
            split = f"{rep['placed']}/{rep['fallback']}" if rep else ""
            lines.append(f"{fmt:20s} {' '.join(f'{s:.2f}' for s in loads):28s} {load_med[fmt]:7.2f} "
                         f"{nbytes / 1e9 / load_med[fmt]:6.1f} {ratio:>15s} "
                         f"{' '.join(f'{s:.2f}' for s in readies):28s} {ready_med[fmt]:7.2f}  {split}")
        ours = load_med.get("gdskit")
        for peer, limit in (("safetensors", 0.5), ("runai_streamer", 0.7)):
            if ours is not None and peer in load_med:
                r = ours / load_med[peer]
                verdicts[f"{mode}: gdskit load <= {limit}x {peer}"] = f"{'met' if r <= limit else 'NOT met'} ({r:.2f}x)"
        if "gdskit" in ready_med and len(ready_med) > 1:
            best = min(ready_med, key=ready_med.__getitem__)
            verdicts[f"{mode}: gdskit the lowest time to first token"] = (
                f"{'met' if best == 'gdskit' else 'NOT met'} (lowest: {best} {ready_med[best]:.2f} s)")
    return lines, verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where the checkpoint is made (once); required")
    ap.add_argument("--size", type=float, default=8, help="checkpoint size in GiB (default 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated: {', '.join(FORMATS)}, or any "
                    f"other vLLM load format by its name (default {DEFAULT_FORMATS})")
    ap.add_argument("--cold", action="store_true", help="also run with the page cache dropped before each engine")
    ap.add_argument("--no-hot", action="store_true", help="skip the hot runs")
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--engine", nargs=2, metavar=("PATH", "FORMAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine(*args.engine)
        return
    if not args.dir:
        ap.error("--dir is required")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    formats = [f for f in args.formats.split(",") if f]
    modes = ([] if args.no_hot else ["hot"]) + (["cold"] if args.cold else [])
    if not modes:
        ap.error("--no-hot without --cold runs nothing")
    from loaders import _shard_files, ensure_llama
    from page_cache import drop_caches, warm

    path = ensure_llama(args.dir, args.size)
    shards = _shard_files(path)
    nbytes = sum(os.path.getsize(f) for f in shards)
    runs: dict[str, dict[str, list[dict]]] = {m: {f: [] for f in formats} for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            for fmt in formats if r % 2 == 0 else formats[::-1]:
                how = drop_caches(shards) if mode == "cold" else (warm(shards) or "warmed")
                res = timed_engine(path, fmt)
                res["cache"] = how
                runs[mode][fmt].append(res)
                shown = f"load {res['load_s']:.2f} s, ready {res['ready_s']:.2f} s" if "load_s" in res else res["error"]
                print(f"round {r + 1} {mode} {fmt}: {shown}", file=sys.stderr, flush=True)
                if "error" in res:
                    print(res["log_tail"], file=sys.stderr)
    print(f"\nvLLM engines, {nbytes / 1e9:.2f} GB checkpoint in {len(shards)} shards, {args.rounds} fresh engines "
          "each, formats alternating")
    lines, verdicts = summarize(runs, formats, nbytes)
    print("\n".join(lines))
    if verdicts:
        print("\ntargets:")
        for k, v in verdicts.items():
            print(f"  {k}: {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv, "bytes": nbytes, "shards": len(shards), "runs": runs,
                       "targets": verdicts}, fh, indent=2)
    raise SystemExit(exit_status(run for per in runs.values() for each in per.values() for run in each))


if __name__ == "__main__":
    main()
