"""A safetensors checkpoint from an S3 server into host or GPU memory: gdskit against the usual ways.

Starts moto's S3 server in a subprocess on a free localhost port, puts one safetensors
checkpoint of ``--size-gib`` GiB (tensors of ``--tensor-mib`` MiB, float32, bfloat16 and int64,
made from a seed), then, in a fresh process each, round after round with the loaders
interleaved (A B C D A B C D ...), times:

- ``gdskit``: ``gdskit.safetensors.load_file("s3://...", device=DEVICE)``;
- ``boto3``: boto3's ``download_file`` to a temporary file, then
  ``safetensors.torch.load_file(..., device=DEVICE)`` (the time of both; the file is removed after);
- ``runai``: Run:ai's streamer (``runai-model-streamer`` with ``runai-model-streamer-s3``),
  ``SafetensorsStreamer().stream_file(url, device=DEVICE)``, every tensor kept (``owned=True``);
- ``ceiling``: the server's own ceiling: ranged GETs of ``--ceiling-part-mib`` MiB,
  ``--ceiling-threads`` at once, each read (botocore ``readinto``) into one preallocated host
  buffer; no parsing, no tensors, host memory whatever ``--device`` says.

DEVICE is ``--device`` (``cpu``, the default, or ``cuda``); into GPU memory the clock stops after
``torch.cuda.synchronize()``, and the digests are taken of the tensors' bytes copied back afterwards.

Each process reports the seconds of the load alone (after its imports), its peak resident size
(``VmHWM``; and the part of it the load added over the imports) and a BLAKE3 digest of every tensor's bytes (the ceiling: of all the bytes); the
parent checks them against the checkpoint it wrote, so every loader is shown to return the same
tensors. A loader that cannot be imported is reported absent, with the reason. Prints a table
(median and range of GB/s, the ratio of the median to the ceiling's, peak RSS) and writes every
figure as JSON with ``--json``.

    python benchmarks/object_load.py                      # 2 GiB, 3 rounds
    python benchmarks/object_load.py --smoke              # 64 MiB, 1 round: does everything run
    python benchmarks/object_load.py --size-gib 1 --rounds 5 --json out.json

The server is Python (werkzeug) on the same machine: on a small machine its rate, not the
loaders', sets the figures, so the ratio to the ceiling is the comparison that carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from object_client import free_port, start_moto  # benchmarks/ is on sys.path when run as a script

MIB = 1 << 20
GIB = 1 << 30
BUCKET = "bench"
KEY = "ckpt/model.safetensors"
LOADERS = ("gdskit", "boto3", "runai", "ceiling")


# -- the server and the checkpoint ------------------------------------------------------------

def environment(endpoint: str) -> dict[str, str]:
    """The variables every loader reads its endpoint and credentials from (nothing of the
    machine's own AWS config)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",  # path-style URLs, as a local server needs
               # The streamer gives up on a GET that sends nothing for 1 s (its default); moto
               # copies the whole object before it answers any GET, which takes longer than that
               # for objects of a GiB or more.
               RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS="300000",
               RUNAI_STREAMER_LOG_LEVEL="WARNING")
    return env


def make_checkpoint(path: str, size: int, tensor_bytes: int) -> dict[str, str]:
    """A safetensors file of about ``size`` bytes written to ``path``; each tensor's digest."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(2026)
    tensors: dict[str, Any] = {}
    kinds = (torch.float32, torch.bfloat16, torch.int64)
    total, i = 0, 0
    while total < size:
        n = min(tensor_bytes, size - total)
        dtype = kinds[i % len(kinds)]
        count = max(1, n // dtype.itemsize)
        if dtype.is_floating_point:
            t = torch.randn(count, generator=gen).to(dtype)
        else:
            t = torch.randint(-2**40, 2**40, (count,), generator=gen, dtype=dtype)
        tensors[f"layer.{i:04d}.{str(dtype).removeprefix('torch.')}"] = t.reshape(-1, 64) if count % 64 == 0 else t
        total += count * dtype.itemsize
        i += 1
    save_file(tensors, path)
    return tensor_digests(tensors)


def tensor_digests(tensors: dict[str, Any]) -> dict[str, str]:
    """Each tensor's dtype, shape and BLAKE3 digest of its bytes."""
    import blake3
    import torch

    return {name: f"{t.dtype}{tuple(t.shape)}:"
                  + blake3.blake3(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in tensors.items()}


def upload(endpoint: str, path: str) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    client.upload_file(path, BUCKET, KEY, Config=TransferConfig(multipart_chunksize=256 * MIB))


# -- one load, in a fresh process ---------------------------------------------------------------

def load_gdskit(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import gdskit.safetensors

    return gdskit.safetensors.load_file(url, device=args.device)


def load_boto3(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import boto3
    import safetensors.torch

    client = boto3.client("s3")
    with tempfile.TemporaryDirectory(prefix="object-load-") as tmp:
        local = os.path.join(tmp, "model.safetensors")
        client.download_file(BUCKET, KEY, local)
        return safetensors.torch.load_file(local, device=args.device)


def load_runai(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_file(url, device=args.device)
        return dict(streamer.get_tensors())


def load_ceiling(url: str, args: argparse.Namespace) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import numpy as np
    from botocore.config import Config

    client = boto3.client("s3", config=Config(max_pool_connections=args.ceiling_threads,
                                              s3={"addressing_style": "path"}))
    size = int(client.head_object(Bucket=BUCKET, Key=KEY)["ContentLength"])
    out = np.empty(size, np.uint8)
    part = args.ceiling_part_mib * MIB

    def fetch(start: int) -> None:
        end = min(size, start + part)
        body = client.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={start}-{end - 1}")["Body"]
        view = memoryview(out)[start:end]
        pos = 0
        while pos < end - start:
            got = body.readinto(view[pos:])
            if not got:
                raise ConnectionError("the body ended early")
            pos += got

    with ThreadPoolExecutor(args.ceiling_threads) as ex:
        list(ex.map(fetch, range(0, size, part)))
    return out


def peak_rss() -> int:
    """This process's peak resident size so far: the kernel's high-water mark of its memory
    (``VmHWM``), which starts anew at exec (``ru_maxrss`` carries the parent's peak over)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(args: argparse.Namespace) -> None:
    """One load, timed after the imports; prints one JSON line."""
    import blake3
    import torch  # imported before the clock starts, for every loader alike

    load = {"gdskit": load_gdskit, "boto3": load_boto3, "runai": load_runai, "ceiling": load_ceiling}[args.child]
    if args.child == "gdskit":
        import gdskit.safetensors  # noqa: F401
    elif args.child == "runai":
        import runai_model_streamer  # noqa: F401
    else:
        import boto3  # noqa: F401
    url = f"s3://{BUCKET}/{KEY}"
    on_gpu = args.device.startswith("cuda")
    if on_gpu:
        torch.empty(1, device=args.device)  # the CUDA context, outside the clock
        torch.cuda.synchronize()
    before = peak_rss()  # the imports' share of the peak
    t0 = time.perf_counter()
    got = load(url, args)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = peak_rss()
    if args.child == "ceiling":
        digests = {"*": blake3.blake3(got).hexdigest()}
        nbytes = int(got.nbytes)
    else:
        digests = tensor_digests({name: t.cpu() for name, t in got.items()})
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
    print(json.dumps({"loader": args.child, "seconds": seconds, "bytes": nbytes, "peak_rss_bytes": peak,
                      "imports_rss_bytes": before, "digests": digests}))


def available(loader: str) -> str | None:
    """None where ``loader`` can run here, else why not."""
    modules = {"gdskit": ["gdskit", "botocore"], "boto3": ["boto3", "safetensors"],
               "runai": ["runai_model_streamer", "runai_model_streamer_s3"], "ceiling": ["boto3"]}[loader]
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def run_child(loader: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", loader, "--device", args.device,
           "--ceiling-part-mib", str(args.ceiling_part_mib), "--ceiling-threads", str(args.ceiling_threads)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"loader": loader, "error": f"took longer than --timeout {args.timeout:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"loader": loader, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


# -- the comparison -------------------------------------------------------------------------------

def summarise(loader: str, runs: list[dict[str, Any]], want: dict[str, str], whole: str) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    same = all((r["digests"] == {"*": whole}) if loader == "ceiling" else (r["digests"] == want) for r in ok)
    rates = [r["bytes"] / r["seconds"] / 1e9 for r in ok]
    return {"loader": loader, "runs": len(runs), "failed": len(runs) - len(ok),
            "errors": sorted({r["error"] for r in runs if "error" in r}),
            "identical": same and bool(ok),
            "gb_s": rates, "gb_s_median": statistics.median(rates) if rates else None,
            "seconds": [r["seconds"] for r in ok], "peak_rss_bytes": [r["peak_rss_bytes"] for r in ok],
            "load_rss_bytes": [r["peak_rss_bytes"] - r["imports_rss_bytes"] for r in ok]}


def table(rows: list[dict[str, Any]], absent: dict[str, str]) -> str:
    ceiling = next((r["gb_s_median"] for r in rows if r["loader"] == "ceiling" and r["gb_s_median"]), None)
    out = ["| loader | GB/s median | min–max | of ceiling | s median | peak RSS, GiB | of it the load's, GiB "
           "| identical tensors |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["gb_s"]:
            out.append(f"| {r['loader']} | failed: {'; '.join(r['errors'])[:200]} | | | | | | |")
            continue
        ratio = f"{r['gb_s_median'] / ceiling:.2f}" if ceiling else "-"
        rss, own = r["peak_rss_bytes"], r["load_rss_bytes"]
        out.append(f"| {r['loader']} | {r['gb_s_median']:.3f} | {min(r['gb_s']):.3f}–{max(r['gb_s']):.3f} | {ratio} | "
                   f"{statistics.median(r['seconds']):.2f} | {_span(rss)} | {_span(own)} | "
                   f"{'yes' if r['identical'] else 'NO'} |")
    for name, why in absent.items():
        out.append(f"| {name} | absent: {why} | | | | | | |")
    return "\n".join(out)


def _span(values: list[int]) -> str:
    lo, hi = min(values) / GIB, max(values) / GIB
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    ap.add_argument("--tensor-mib", type=int, default=32, help="bytes of one tensor (default 32 MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every loader, interleaved (default 3)")
    ap.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated, of {', '.join(LOADERS)}")
    ap.add_argument("--smoke", action="store_true", help="64 MiB, 1 round: a quick run of everything")
    ap.add_argument("--ceiling-part-mib", type=int, default=64, help="ranged GET size of the ceiling (default 64)")
    ap.add_argument("--ceiling-threads", type=int, default=16, help="GETs in flight for the ceiling (default 16)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one load may take")
    ap.add_argument("--device", default="cpu", help="where the tensors go: cpu (default) or cuda[:N]")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.smoke:
        args.size_gib, args.rounds = 1 / 16, 1
    loaders = [name.strip() for name in args.loaders.split(",") if name.strip()]
    unknown = [n for n in loaders if n not in LOADERS]
    if unknown:
        ap.error(f"unknown loaders: {', '.join(unknown)}")
    absent = {n: why for n in loaders if (why := available(n)) is not None}
    loaders = [n for n in loaders if n not in absent]
    size = int(args.size_gib * GIB)

    import blake3

    port = free_port()
    server = start_moto(port)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        with tempfile.TemporaryDirectory(prefix="object-load-src-") as tmp:
            path = os.path.join(tmp, "model.safetensors")
            want = make_checkpoint(path, size, args.tensor_mib * MIB)
            with open(path, "rb") as f:
                whole = blake3.blake3(f.read()).hexdigest()
            file_bytes = os.path.getsize(path)
            upload(endpoint, path)
        env = environment(endpoint)
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in loaders}
        for rnd in range(args.rounds):
            for name in loaders:
                result = run_child(name, env, args)
                runs[name].append(result)
                shown = (f"{result['bytes'] / result['seconds'] / 1e9:.3f} GB/s, peak RSS "
                         f"{result['peak_rss_bytes'] / GIB:.2f} GiB" if "error" not in result else result["error"])
                print(f"round {rnd + 1} {name}: {shown}", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    rows = [summarise(n, runs[n], want, whole) for n in loaders]
    print(f"{file_bytes / GIB:.2f} GiB safetensors checkpoint ({len(want)} tensors) into {args.device}, "
          f"{args.rounds} rounds, "
          f"{platform.node()}, {os.cpu_count()} CPUs")
    print(table(rows, absent))
    if args.json:
        doc = {"device": args.device, "file_bytes": file_bytes, "tensors": len(want), "rounds": args.rounds, "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d"), "absent": absent, "loaders": rows,
               "runs": {n: [{k: v for k, v in r.items() if k != "digests"} for r in rs] for n, rs in runs.items()},
               "versions": versions()}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if any(not r["identical"] or r["failed"] for r in rows):
        sys.exit(1)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("gdskit", "boto3", "botocore", "safetensors", "torch", "moto", "runai-model-streamer",
                 "runai-model-streamer-s3"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    main()
