"""A real S3 server for the object storage tests: moto's server in a subprocess on a free
localhost port, and a small HTTP proxy in front of it that injects faults (503 SlowDown
answers, connections closed mid-body, a hook run before a GET is forwarded, the answer of a
completed multipart upload lost).

Where moto answers differently from S3 the proxy answers as S3 does: a multipart upload once
completed is gone (a second CompleteMultipartUpload of it is 404 NoSuchUpload), and a listing of
pending uploads gives the time each upload was started (moto's says 2010-11-10 for all).

Test modules import the fixtures: ``from object_server import moto_endpoint, s3  # noqa: F401``.
"""

from __future__ import annotations

import http.client
import http.server
import os
import re
import socket
import socketserver
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("moto")
boto3 = pytest.importorskip("boto3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's S3 server, in its own process, for the whole session."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto's S3 server did not start")
            time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client_for(endpoint: str) -> Any:
    """A boto3 client of the test itself (its reads bypass gdskit)."""
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


@dataclass
class S3:
    """A fresh bucket on the server, the environment pointing gdskit at ``endpoint``."""

    endpoint: str
    bucket: str
    client: Any
    monkeypatch: Any

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def keys(self) -> list[str]:
        return [o["Key"] for o in self.client.list_objects_v2(Bucket=self.bucket).get("Contents", ())]

    def pending_uploads(self) -> list[Any]:
        return self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])

    def point_at(self, endpoint: str) -> None:
        """Send gdskit's requests to ``endpoint`` (a fault proxy in front of the server)."""
        import gdskit.engine as engine

        self.monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        engine.forget_object_clients()


def aws_environment(monkeypatch: Any, endpoint: str, tmp: str) -> None:
    """Dummy credentials, the endpoint, and nothing from the machine's own AWS config."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.path.join(tmp, "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.path.join(tmp, "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: Any, tmp_path: Any) -> Iterator[S3]:
    import gdskit.engine as engine

    aws_environment(monkeypatch, moto_endpoint, str(tmp_path))
    engine.forget_object_clients()
    client = client_for(moto_endpoint)
    bucket = "t-" + uuid.uuid4().hex[:20]
    client.create_bucket(Bucket=bucket)
    try:
        yield S3(moto_endpoint, bucket, client, monkeypatch)
    finally:
        engine.forget_object_clients()


# -- the fault proxy ---------------------------------------------------------------------------

@dataclass
class Faults:
    """What the proxy does to the requests it forwards. Counters go down as faults are served."""

    slow_down: int = 0            # answer this many GETs with 503 SlowDown
    cut_mid_body: int = 0         # send half of this many GET bodies, then close the connection
    fail_part_uploads: int = 0    # answer this many part uploads (PUT ?partNumber=) with 500
    refuse_heads: int = 0         # answer this many HEADs with 403 AccessDenied
    fail_aborts: int = 0          # answer this many upload aborts (DELETE ?uploadId=) with 500
    lose_complete_answers: int = 0  # complete this many multipart uploads, then close without an answer
    after_lost_complete: Callable[[], None] | None = None  # called once the server completed one of those
    before_get: Callable[[int], None] | None = None  # called with the GET's number before it is forwarded
    gets: int = 0
    served_faults: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request
    completed: set[str] = field(default_factory=set)  # upload ids the server completed
    initiated: dict[str, float] = field(default_factory=dict)  # upload id -> when the proxy started it
    endpoint: str = ""  # the proxy's own URL
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, name: str) -> bool:
        with self.lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
                self.served_faults += 1
                return True
            return False


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        faults = self.server.faults
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with faults.lock:
            faults.requests.append((self.command, self.path))
        upload_id = _query_value(self.path, "uploadId")
        is_complete = self.command == "POST" and upload_id is not None
        if is_complete and upload_id in faults.completed:
            self._answer(404, b"<Error><Code>NoSuchUpload</Code><Message>The specified multipart upload does not "
                              b"exist.</Message></Error>")
            return
        if self.command == "HEAD" and faults.take("refuse_heads"):
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        is_get = self.command == "GET" and "list-type" not in self.path and "uploads" not in self.path
        if is_get:
            with faults.lock:
                faults.gets += 1
                number = faults.gets
            if faults.before_get is not None:
                faults.before_get(number)
            if faults.take("slow_down"):
                self._answer(503, b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate."
                                  b"</Message></Error>")
                return
        if self.command == "DELETE" and upload_id is not None and faults.take("fail_aborts"):
            self._answer(500, b"<Error><Code>InternalError</Code><Message>injected</Message></Error>")
            return
        if self.command == "PUT" and "partNumber=" in self.path and faults.take("fail_part_uploads"):
            self._answer(500, b"<Error><Code>InternalError</Code><Message>injected</Message></Error>")
            return
        conn = http.client.HTTPConnection(self.server.upstream_host, self.server.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            headers["Host"] = f"{self.server.upstream_host}:{self.server.upstream_port}"
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            data = self._as_s3(faults, resp.status, data)
            if is_complete and resp.status == 200 and b"<Error>" not in data:
                faults.completed.add(upload_id)
                if faults.take("lose_complete_answers"):
                    if faults.after_lost_complete is not None:
                        faults.after_lost_complete()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
            self.send_response(resp.status, resp.reason)
            head = self.command == "HEAD"  # its Content-Length is the object's, with no body
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if is_get and resp.status in (200, 206) and len(data) > 1 and faults.take("cut_mid_body"):
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    def _as_s3(self, faults: Faults, status: int, data: bytes) -> bytes:
        """Note when each upload starts; give a listing of uploads those times."""
        if status != 200:
            return data
        if self.command == "POST" and re.search(r"[?&]uploads(=|&|$)", self.path):
            started = re.search(rb"<UploadId>([^<]+)</UploadId>", data)
            if started:
                with faults.lock:
                    faults.initiated[started.group(1).decode()] = time.time()
        elif self.command == "GET" and re.search(r"[?&]uploads(=|&|$)", self.path):
            def timed(block: re.Match[bytes]) -> bytes:
                uid = re.search(rb"<UploadId>([^<]+)</UploadId>", block.group(0))
                when = faults.initiated.get(uid.group(1).decode()) if uid else None
                if when is None:
                    return block.group(0)
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when % 1 * 1000):03d}Z"
                return re.sub(rb"<Initiated>[^<]*</Initiated>", b"<Initiated>" + stamp.encode() + b"</Initiated>",
                              block.group(0))

            data = re.sub(rb"<Upload>.*?</Upload>", timed, data, flags=re.S)
        return data

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


def _query_value(path: str, name: str) -> str | None:
    from urllib.parse import parse_qs, urlsplit  # noqa: PLC0415 - import time

    values = parse_qs(urlsplit(path).query, keep_blank_values=True).get(name)
    return values[0] if values else None


class _ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream: str, faults: Faults) -> None:
        host, port = upstream.split("//", 1)[1].split(":")
        self.upstream_host, self.upstream_port = host, int(port)
        self.faults = faults
        super().__init__(("127.0.0.1", 0), _Handler)


@pytest.fixture
def fault_proxy(s3: S3) -> Iterator[Faults]:
    """A proxy in front of the server, with gdskit pointed at it; set its :class:`Faults`."""
    faults = Faults()
    server = _ProxyServer(s3.endpoint, faults)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    faults.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    s3.point_at(faults.endpoint)
    try:
        yield faults
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
