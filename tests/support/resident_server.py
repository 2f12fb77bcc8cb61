"""A real resident loader (``gdskit serve``) in a child process, for tests: started, waited for
until it listens, stopped with SIGTERM (its exit status and printed events kept)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest


class ServerProcess:
    def __init__(self, runtime_dir: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {}), "XDG_RUNTIME_DIR": runtime_dir}
        self.proc = subprocess.Popen([sys.executable, "-m", "gdskit", "serve", "--json", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        self.events: list[dict] = []
        self.socket = ""

    def wait_listening(self, timeout: float = 60) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"gdskit serve ended: {self.proc.wait()} {self.proc.stderr.read()}")
            event = json.loads(line)
            self.events.append(event)
            if event["event"] == "listening":
                self.socket = event["socket"]
                return self
        raise RuntimeError("gdskit serve did not listen in time")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _err = self.proc.communicate(timeout=30)
        self.events += [json.loads(line) for line in out.splitlines() if line.strip()]
        return self.proc.returncode

    def kinds(self) -> list[str]:
        return [e["event"] for e in self.events]


@pytest.fixture
def runtime_dir(monkeypatch):
    """A fresh ``XDG_RUNTIME_DIR`` for the test (short: a Unix socket's path must fit 107 bytes)."""
    d = tempfile.mkdtemp(prefix="gr")
    os.chmod(d, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    yield d
    subprocess.run(["rm", "-rf", d], check=False)
