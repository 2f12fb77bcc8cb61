"""``gdskit serve``: the resident loader of one GPU, in the foreground (docs/resident.md).

Exit status: 0 stopped by Ctrl-C or SIGTERM; 2 it could not start (no such GPU, a loader
already listening, a socket directory that is not this user's alone).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
from typing import Any

import typer

from gdskit.cli import cli_errors

_HELP = (
    "Keep gdskit's engine warm for one GPU (modules imported, pinned lanes registered, worker "
    "threads started) and read checkpoints and preloaded files into other processes' memory on this GPU: a fresh "
    "program's first load then runs at a warm one's rate. Loads of this user use it where it "
    "listens (GDSKIT_RESIDENT=auto, the default; off: never; require: always or an error).\n\n"
    "The socket is $XDG_RUNTIME_DIR/gdskit/resident-<GPU UUID>.sock (else /tmp/gdskit-<uid>/), in a "
    "directory only this user can enter; other users' connections are refused. One line is "
    "printed per load (--json: one JSON object per line). Ctrl-C or SIGTERM stops it."
)


def register(app: typer.Typer) -> None:
    app.command("serve", help=_HELP)(serve)


def serve(
    device: int = typer.Option(0, "--device", "-d", min=0, help="The GPU to serve (as CUDA numbers it here)."),
    host: bool = typer.Option(False, "--host", help="Serve host memory only (a machine without a GPU; tests)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line, for programs."),
    unit: bool = typer.Option(False, "--unit", help="Print a systemd user unit that runs one loader per GPU "
                              "(gdskit-serve@N.service) with this Python, and exit."),
) -> None:
    if unit:
        sys.stdout.write(unit_text(sys.executable))
        return
    from gdskit.engine.resident.server import ResidentLoader  # noqa: PLC0415 - import time

    printing = threading.Lock()  # events come from each request's thread: one whole line at a time

    def line(text: str) -> None:
        with printing:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def say(kind: str, detail: dict[str, Any]) -> None:
        if as_json:
            line(json.dumps({"event": kind, **detail}))
        elif kind == "served":
            more = detail.get("files", 1) - 1
            what = f"{detail['path']} and {more} more file{'s' if more > 1 else ''}" if more else detail["path"]
            line(f"served {what}: {detail['bytes'] / 1e9:.2f} GB in {detail['seconds'] * 1e3:.0f} ms "
                 f"({detail['bytes'] / max(detail['seconds'], 1e-9) / 1e9:.1f} GB/s)")
        elif kind == "listening":
            line(f"gdskit serve: {detail['serves']} at {detail['socket']}; Ctrl-C to stop")
        elif kind == "stopped":
            t = detail["totals"]
            line(f"gdskit serve: stopped after {t['requests']} loads ({t['bytes'] / 1e9:.2f} GB), "
                 f"{t['refused']} refused, {t['failed']} failed")
        else:
            line(f"{kind}: {detail.get('why') or detail.get('error')}")

    loader = ResidentLoader(None if host else device, on_event=say)
    with cli_errors("serve"):
        path = loader.start()

    def on_signal(_signum: int, _frame: Any) -> None:
        loader.request_stop()  # only a flag here: the main thread closes once serving returns

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        say("listening", {"socket": path, "serves": "host memory" if host else f"GPU {device} ({loader.gpu})",
                          "gpu": loader.gpu})
        with cli_errors("serve"):
            loader.serve_forever()
    finally:
        loader.close()
        for s, h in previous.items():
            signal.signal(s, h)
    say("stopped", {"totals": loader.totals.as_dict()})


def unit_text(python: str) -> str:
    """A systemd user unit template whose instance is the GPU number, running ``python -m gdskit
    serve``. SIGTERM (``systemctl --user stop``) ends it once a load under way has ended."""
    return f"""\
# gdskit's resident loader, one instance per GPU (docs/resident.md). Save as
#   ~/.config/systemd/user/gdskit-serve@.service
# then: systemctl --user daemon-reload && systemctl --user enable --now gdskit-serve@0
# Programs find it where their XDG_RUNTIME_DIR is this manager's (/run/user/<uid>).
# Settings: add Environment=GDSKIT_...=... lines under [Service].
[Unit]
Description=gdskit resident loader for GPU %i

[Service]
Type=exec
ExecStart={_unit_program(python)} -m gdskit serve --device %i --json
Restart=on-failure
RestartSec=5

[Install]
WantedBy=default.target
"""


def _unit_program(path: str) -> str:
    """``path`` as the program of a unit's ExecStart: quoted (spaces), its ``%`` doubled (systemd's
    specifiers); systemd itself refuses quotes, backslashes and control characters there."""
    if re.search(r"[\x00-\x1f\x7f\\\"']", path):
        raise typer.BadParameter(f"systemd cannot run a program whose path holds quotes, backslashes or control "
                                 f"characters: {path!r}")
    return '"' + path.replace("%", "%%") + '"'
