"""Bench workers in processes of their own (``gdskit bench --processes``), as fio's jobs are.

Worker threads of one Python process take turns at the interpreter lock between
I/Os. When the disk answers a 4 KiB read in tens of microseconds, those turns
cost throughput the storage has, so a thread-mode figure says "what one Python
process gets", not "what the storage gives". With ``--processes`` each worker is
its own Python process running the very same loop (:func:`gdskit.bench.worker.work`) through
its own gdskit engine, and the numbers compare with fio's ``numjobs`` and with
gdsio's C threads.

The processes start once per benchmark (``python -m gdskit.bench.procs``; no
``fork`` of a process that may hold a CUDA context) and serve every run: the
parent sends each one its plan and slice, waits until all have opened their file
and done their warm-up I/O, then starts them together and gathers what each did,
its ledger delta, cuFile's counters and its CPU time. Messages are pickles over
the child's stdin and a private copy of its stdout; the child's own stdout goes
to stderr so that a stray print cannot break the stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

import gdskit
from gdskit.engine import cuda
from gdskit.bench import cpu as cpu_mod
from gdskit.bench import worker
from gdskit.bench.params import PathUnavailableError
from gdskit.errors import GdskitError, GdskitIOError, WorkerProcessError
from gdskit.threads import take_signals_back

#: How long a worker process gets to exit after being asked, before it is killed.
_EXIT_GRACE_S = 5.0


# -- the parent's side ------------------------------------------------------------------
class WorkerProcesses:
    """``n`` worker processes for the runs of one benchmark; :meth:`close` ends them."""

    def __init__(self, n: int) -> None:
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(gdskit.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        self._children: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(n):
                try:
                    self._children.append(subprocess.Popen(
                        [sys.executable, "-m", "gdskit.bench.procs"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, env=env, close_fds=True))
                except OSError as exc:
                    raise WorkerProcessError(f"cannot start a bench worker process with {sys.executable!r}: "
                                             f"{exc}") from exc
        except BaseException:
            self.close(now=True)
            raise

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(now=exc_type is not None)  # interrupted or failed: no waiting for a run to end

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._children]

    def _send(self, child: subprocess.Popen[bytes], msg: object) -> None:
        try:
            pickle.dump(msg, child.stdin, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[arg-type]
            child.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            raise self._died(child) from None

    def _recv(self, child: subprocess.Popen[bytes]) -> Any:
        try:
            return pickle.load(child.stdout)  # type: ignore[arg-type]
        except (EOFError, OSError, pickle.UnpicklingError):
            raise self._died(child) from None

    @staticmethod
    def _died(child: subprocess.Popen[bytes]) -> WorkerProcessError:
        try:
            rc = child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            rc = None
        how = f"exit status {rc}" if rc is not None and rc >= 0 else (
            f"signal {-rc}" if rc is not None else "no answer")
        return WorkerProcessError(f"bench worker process {child.pid} ended unexpectedly ({how}); "
                                  "its error, if any, is on stderr above")

    def run(self, plan: worker.RunPlan, targets: worker.Targets, deadline_s: float | None) -> worker.RunWindow:
        """One run with every process as one worker; see the module docstring."""
        kids = self._children
        for w, child in enumerate(kids):
            self._send(child, ("prepare", plan, w, targets.slices[w]))
        replies = [self._recv(child) for child in kids]
        failed = [r for r in replies if r[0] != "ready"]
        if failed:
            for child, r in zip(kids, replies):
                if r[0] == "ready":
                    self._send(child, ("stop",))
            kind, *rest = failed[0]
            if kind == "unavailable":
                raise PathUnavailableError(*rest)
            raise rest[0]
        if plan.cold:
            worker.make_cold(targets.files, False)
        cpu_before = cpu_mod.sample()
        t_start = time.perf_counter()
        # CLOCK_MONOTONIC, which perf_counter reads on Linux, is the same clock in every process.
        end = t_start + deadline_s if deadline_s else 0.0
        for child in kids:
            self._send(child, ("go", end))
        done = [self._recv(child) for child in kids]
        t_end = time.perf_counter()
        cost = cpu_mod.cpu_cost(cpu_before, cpu_mod.sample())
        user = sum(d[4] for d in done)
        system = sum(d[5] for d in done)
        cost = dataclasses.replace(cost, process_user_s=cost.process_user_s + user,
                                   process_system_s=cost.process_system_s + system,
                                   process_cpu_s=cost.process_cpu_s + user + system)
        ledger = done[0][2]
        for d in done[1:]:
            ledger = ledger + d[2]
        counters = None
        if all(d[3] is not None for d in done) and plan.name == "cufile":
            counters = {}
            for d in done:
                for k, v in d[3].items():
                    counters[k] = counters.get(k, 0) + v
        return worker.RunWindow([d[1] for d in done], t_end - t_start, cost, ledger, counters)

    def close(self, now: bool = False) -> None:
        """Ask every process to exit; kill those that do not within a few seconds (at once
        with ``now``: a process may be in the middle of a run of many seconds)."""
        for child in self._children:
            with contextlib.suppress(Exception):
                if now:
                    child.kill()
                pickle.dump(("exit",), child.stdin)  # type: ignore[arg-type]
                child.stdin.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + _EXIT_GRACE_S
        for child in self._children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            with contextlib.suppress(Exception):
                child.stdout.close()  # type: ignore[union-attr]
        self._children = []


# -- the worker's side --------------------------------------------------------------------
def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself, else a GdskitError that says what it was."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc):
            return exc
    except Exception:
        pass
    if isinstance(exc, OSError):
        return GdskitIOError(exc.errno or 5, f"{type(exc).__name__}: {exc}")
    return GdskitError(f"{type(exc).__name__}: {exc}")


def _cpu_s() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def _serve_run(plan: worker.RunPlan, w: int, slice_: tuple[str, int, int], rin: IO[bytes],
               send: Any) -> None:
    """Prepare, wait for the start, run, answer: one run of this worker."""
    with gdskit.settings.set(**{**plan.settings, **plan.forced}), contextlib.ExitStack() as stack:
        try:
            if plan.on_device:
                cuda.set_device(plan.params.device)
            f, b = worker.open_worker(plan, w, slice_, stack)
        except PathUnavailableError as exc:
            send(("unavailable", str(exc), exc.path, exc.reason))
            return
        except Exception as exc:  # noqa: BLE001 - handed to the parent
            send(("error", _portable(exc)))
            return
        send(("ready",))
        cmd = pickle.load(rin)
        if cmd[0] != "go":
            return
        out = worker.WorkerOut()
        counters_before = worker.run_counters(plan)
        ledger_before = gdskit.stats()
        user0, sys0 = _cpu_s()
        try:
            worker.work(plan, w, slice_, f, b, out, threading.Event(), cmd[1])
            if not plan.params.op.is_read and plan.cold:
                f.fsync()  # cold writes count until the data is on the device
        except Exception as exc:  # noqa: BLE001 - handed to the parent
            out.error = _portable(exc)
        user1, sys1 = _cpu_s()
        ledger = gdskit.stats() - ledger_before
        counters_after = worker.run_counters(plan)
    send(("done", out, ledger, worker.counter_delta(counters_before, counters_after), user1 - user0,
          sys1 - sys0))


def _child_main() -> None:
    take_signals_back()  # a SIGTERM from the parent ends us, whichever thread started us
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us
    wout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the message stream
    rin = sys.stdin.buffer

    def send(msg: object) -> None:
        pickle.dump(msg, wout, protocol=pickle.HIGHEST_PROTOCOL)
        wout.flush()

    while True:
        try:
            msg = pickle.load(rin)
        except EOFError:
            return
        if msg[0] == "prepare":
            try:
                _serve_run(*msg[1:], rin, send)
            except (EOFError, BrokenPipeError):
                return  # the benchmark has gone away: nothing to report to
        elif msg[0] == "exit":
            return


if __name__ == "__main__":
    _child_main()
