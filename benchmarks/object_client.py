"""Ranged GETs of one object from a local S3 server: obstore against boto3 (and the AWS CRT).

Starts moto's S3 server in a subprocess on a free localhost port, puts one object of
``--size-mib`` MiB, and reads it whole by ranged GETs of each part size at each concurrency,
every part copied once into one preallocated host buffer (as gdskit copies a part into a pinned
lane). Prints one line per (client, part size, concurrency) and writes them as JSON with
``--json``, with the client's own CPU seconds per GiB (this process's, not the server's). The
bytes read are compared with the object's.

    python benchmarks/object_client.py --size-mib 256 --parts 8,16,32 --concurrency 4,8,16

The server is Python (werkzeug) on the same machine: the figures compare the clients' cost on
top of one server, not a store's ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def parts(size: int, part: int) -> list[tuple[int, int]]:
    return [(s, min(part, size - s)) for s in range(0, size, part)]


def run_threads(fetch, size: int, part: int, workers: int, out: np.ndarray) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda p: fetch(p[0], p[1], out), parts(size, part)))
    return time.perf_counter() - t0


def obstore_fetch(endpoint: str, bucket: str, key: str):
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint, region="us-east-1", allow_http=True,
                    access_key_id="testing", secret_access_key="testing", virtual_hosted_style_request=False)

    def fetch(start: int, n: int, out: np.ndarray) -> None:
        got = store.get(key, options={"range": (start, start + n)}).bytes()
        out[start:start + n] = np.frombuffer(memoryview(got), np.uint8)

    return fetch


def boto3_fetch(endpoint: str, bucket: str, key: str):
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing", config=Config(max_pool_connections=64))

    def fetch(start: int, n: int, out: np.ndarray) -> None:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")["Body"]
        view = memoryview(out)[start:start + n]
        pos = 0
        while pos < n:
            chunk = body.read(min(n - pos, 4 * MIB))
            if not chunk:
                raise RuntimeError("short body")
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)

    return fetch


def botocore_readinto_fetch(endpoint: str, bucket: str, key: str):
    """botocore's streaming body read straight into the destination (``readinto``): no bytes object."""
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing", config=Config(max_pool_connections=64))

    def fetch(start: int, n: int, out: np.ndarray) -> None:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")["Body"]
        view = memoryview(out)[start:start + n]
        pos = 0
        while pos < n:
            got = body.readinto(view[pos:pos + min(n - pos, 8 * MIB)])
            if not got:
                raise RuntimeError("short body")
            pos += got

    return fetch


def gdskit_read(endpoint: str, bucket: str, key: str, size: int, part: int, workers: int, out: np.ndarray) -> float:
    """gdskit itself: ``gdskit.open("s3://...").read`` into host memory with these settings."""
    import gdskit

    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    with gdskit.settings.set(s3_part_size=part, s3_concurrency=workers), gdskit.open(f"s3://{bucket}/{key}") as f:
        t0 = time.perf_counter()
        f.read(out)
        return time.perf_counter() - t0


def crt_read(endpoint: str, bucket: str, key: str, size: int, part: int, workers: int, out: np.ndarray) -> float:
    """The AWS CRT's S3 client: one GET meta-request it splits into ranged parts itself."""
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType

    elg = EventLoopGroup(workers)
    boot = ClientBootstrap(elg, DefaultHostResolver(elg))
    creds = AwsCredentialsProvider.new_static("testing", "testing")
    client = S3Client(bootstrap=boot, region="us-east-1", credential_provider=creds, part_size=part,
                      tls_mode=S3RequestTlsMode.DISABLED, throughput_target_gbps=10.0)
    host = endpoint.split("//", 1)[1]
    req = HttpRequest("GET", f"/{bucket}/{key}", HttpHeaders([("host", host)]))
    view = memoryview(out)

    def on_body(chunk: bytes, offset: int, **_kw: object) -> None:
        view[offset:offset + len(chunk)] = chunk

    t0 = time.perf_counter()
    meta = client.make_request(type=S3RequestType.GET_OBJECT, request=req, on_body=on_body,
                               max_active_connections_override=workers)  # endpoint: the host header
    meta.finished_future.result()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--parts", default="8,16,32")
    ap.add_argument("--concurrency", default="4,8,16")
    ap.add_argument("--clients", default="obstore,boto3,botocore-readinto,crt,gdskit")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    size = args.size_mib * MIB
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = start_moto(port)
    rows = []
    try:
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
        s3.create_bucket(Bucket="bench")
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        s3.put_object(Bucket="bench", Key="obj", Body=data.tobytes())
        out = np.empty(size, np.uint8)
        for client in args.clients.split(","):
            for part in (int(p) * MIB for p in args.parts.split(",")):
                for workers in (int(c) for c in args.concurrency.split(",")):
                    out[:] = 0
                    cpu0 = time.process_time()
                    if client == "gdskit":
                        elapsed = gdskit_read(endpoint, "bench", "obj", size, part, workers, out)
                    elif client == "crt":
                        try:
                            elapsed = crt_read(endpoint, "bench", "obj", size, part, workers, out)
                        except Exception as exc:  # noqa: BLE001 - reported as a row
                            print(f"crt: {exc!r}")
                            break
                    else:
                        fetch = {"obstore": obstore_fetch, "boto3": boto3_fetch,
                                 "botocore-readinto": botocore_readinto_fetch}[client](endpoint, "bench", "obj")
                        elapsed = run_threads(fetch, size, part, workers, out)
                    cpu = time.process_time() - cpu0  # this process only: the client, not the server
                    ok = bool(np.array_equal(out, data))
                    row = {"client": client, "part_mib": part // MIB, "concurrency": workers,
                           "seconds": round(elapsed, 3), "mb_s": round(size / elapsed / 1e6, 1),
                           "client_cpu_s_per_gib": round(cpu / (size / (1 << 30)), 3), "equal": ok}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    main()
