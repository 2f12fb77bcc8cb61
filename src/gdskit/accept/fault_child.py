"""The child process of one fault case of item 7 (``gdskit accept``); not for use on its own.

    python -m gdskit.accept.fault_child --case compat|register|tmpfs --dir D --size N [--device 0]

It installs its fault, writes known data through gdskit in ``auto`` mode, reads it
back, compares every byte and prints one JSON line with the ledger. The faults:

``compat``
    Nothing here: the parent points ``CUFILE_ENV_PATH_JSON`` at a cufile.json with
    ``force_compat_mode`` set. After the ``auto`` pass, a second pass forces
    ``mode="cufile"`` to show that cuFile itself now runs its POSIX path.
``register``
    ``cuFileHandleRegister`` is replaced, in this process only, by a function that
    fails, and gdskit is told a direct route exists (``direct_route.override``), so
    that ``auto`` mode reaches the registration even on a machine with no direct route.
``tmpfs``
    Nothing here: the parent passes a directory on tmpfs.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from typing import Any

import gdskit
from gdskit.accept.workload import raw_round_trip
from gdskit.engine import direct_path as route
from gdskit.errors import DirectPathUnavailable
from gdskit.vocabulary import Path

CASES = ("compat", "register", "tmpfs")


def refuse_registration(bindings: Any = None) -> dict[str, Any]:
    """Make cuFile handle registration fail in this process; returns the live count of refusals.

    ``bindings`` is the ``cuda.bindings.cufile`` module gdskit's cuFile backend calls (default: imported).
    """
    hits: dict[str, Any] = {"refused": 0}
    if bindings is None:
        try:
            from cuda.bindings import cufile as bindings  # noqa: PLC0415 - import time
        except Exception as exc:  # no bindings: registration fails by itself (cufile_missing)
            hits["note"] = f"cuda.bindings.cufile not importable ({type(exc).__name__}); nothing to refuse"
            return hits

    def refuse(*_args: Any, **_kw: Any) -> int:
        hits["refused"] += 1
        raise OSError(errno.EIO, "cuFileHandleRegister refused (gdskit accept fault injection)")

    bindings.handle_register = refuse
    return hits


def pretend_direct_route() -> Any:
    """Tell every part of gdskit (the router, the cuFile backend) that this machine has a direct
    route, so that ``auto`` mode tries cuFile; for the rest of the process, or until the
    returned override ends (used as a context manager)."""
    real = route.direct_route()
    return route.override(route.DirectRoute(real.route or Path.CUFILE_NVFS, None, real.nvidia_fs, real.p2pdma,
                                            real.udev))


def forced_cufile_pass(directory: str, nbytes: int, device: int) -> dict[str, Any]:
    """The same round trip with ``mode="cufile"``: cuFile must still move the data, through its POSIX path."""
    try:
        with gdskit.settings.set(mode="cufile"):
            return raw_round_trip(directory, nbytes, device, name="gdskit-accept-cufile.bin")
    except DirectPathUnavailable as exc:
        return {"refused": True, "reason": exc.reason.value, "detail": str(exc)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdskit.accept.fault_child")
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)

    from gdskit.engine import cuda  # noqa: PLC0415 - import time

    device = args.device if cuda.device_count() > args.device else None
    out: dict[str, Any] = {"case": args.case, "memory": "device" if device is not None else "host"}
    hits = None
    if args.case == "register":
        hits = refuse_registration()
        pretend_direct_route()
    out["auto"] = raw_round_trip(args.dir, args.size, device)
    if hits is not None:
        out["registration"] = hits
    if args.case == "compat" and device is not None:
        out["cufile_mode"] = forced_cufile_pass(args.dir, args.size, device)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
