"""Run one test case in a child process with a memory cap and a timeout.

A fuzz or mutation case that makes the code under test allocate without bound must fail that
case, not take the test run (or the machine) down with it. :func:`run_capped` runs
``fn(*args, **kwargs)`` in a forked child whose address space may grow by at most
``cap_bytes`` beyond what it had when forked (``resource.setrlimit(RLIMIT_AS, ...)``: an
allocation past the cap raises ``MemoryError`` in the child), kills the child after
``timeout_s`` seconds, and reports what happened as an :class:`Outcome`::

    from memory_cap import run_capped

    outcome = run_capped(read_metadata_of, blob, cap_bytes=256 << 20, timeout_s=30)
    assert outcome.status == "raised" and outcome.error == "FormatError", outcome

    outcome = run_capped(lambda: parse(blob))          # closures work: the child is forked
    value = outcome.result()                           # the returned value, or AssertionError

``Outcome.status`` is one of:

- ``"returned"``: ``fn`` returned; ``value`` holds what it returned (pickled back to the
  parent, so it must pickle; an unpicklable value comes back as its ``repr``).
- ``"raised"``: ``fn`` raised; ``error`` is the exception's class name (``"FormatError"``,
  ``"MemoryError"`` when the cap was hit), ``error_bases`` the names of every class in its
  MRO (so ``"GdskitError" in outcome.error_bases`` asks ``isinstance``), ``detail`` its
  formatted traceback, for the assertion message only (never assert on it).
- ``"killed"``: the child died of signal ``signal`` (a segfault, the OOM killer) or exited
  without reporting.
- ``"timed_out"``: the child ran past ``timeout_s`` and was killed.

``Outcome.peak_rss_growth`` is how far the child's resident memory rose above its size at the
start of ``fn`` at its highest (bytes), so that a test can ask that a case was cheap as well as
bounded; None where the child did not report. It is the larger of two readings, each of which can
only fall short of the truth, never exceed it: the kernel's peak (``VmHWM``, reset at the start
through ``/proc/self/clear_refs``), which falls short when memory pressure reclaims file pages the
child shares with its parent while the case runs, and the highest anonymous size (``RssAnon`` plus
``VmSwap``) sampled every millisecond by a thread of the child, which reclaim cannot shrink but which can miss
a peak shorter than a sample.

Many cases can share one child: pass a function that loops over them (a hypothesis
``@given`` test included) and let the cap and the timeout bound the whole loop. Linux only
(fork, ``/proc/self/status``).
"""

from __future__ import annotations

import multiprocessing
import pickle
import resource
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Default extra address space a case may take: enough for any sane input of a test's size.
DEFAULT_CAP_BYTES = 1 << 30
#: Default wall-clock limit of one child, from fork to report.
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Outcome:
    """What became of one capped child: see the module docstring for ``status``."""

    status: str
    value: Any = None
    error: str | None = None
    error_bases: tuple[str, ...] = ()
    detail: str = ""
    signal: int | None = None
    exitcode: int | None = None
    peak_rss_growth: int | None = None
    #: The two readings ``peak_rss_growth`` is the larger of: (kernel peak, sampled anonymous peak).
    peak_readings: tuple[int, int] | None = None

    def raised(self, name: str) -> bool:
        """Whether the child raised an instance of the class called ``name`` (or a subclass)."""
        return self.status == "raised" and name in self.error_bases

    def result(self) -> Any:
        """The value ``fn`` returned; AssertionError (with the whole outcome) otherwise."""
        if self.status != "returned":
            raise AssertionError(f"the capped child did not return: {self}")
        return self.value


def _status() -> dict[str, int]:
    """The sizes this process's ``/proc/self/status`` gives (``VmSize``, ``VmRSS``, ...), in bytes."""
    sizes = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                sizes[name] = int(fields[0]) * 1024
    return sizes


def _status_bytes(field: str) -> int:
    """A size this process's ``/proc/self/status`` gives, in bytes."""
    size = _status().get(field)
    if size is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return size


def _cap_address_space(cap_bytes: int) -> None:
    """Let this process's address space grow by at most ``cap_bytes`` from now on."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _status_bytes("VmSize") + cap_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _reset_peak() -> None:
    """Make ``VmHWM`` the resident size now (the peak a fork inherits is its parent's moment)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:  # kernels before 4.0: the peak stays the parent's at the fork
        pass


def _anon_bytes() -> int:
    """Anonymous memory, resident or swapped out (a page swapped out under pressure still counts);
    the whole resident size where the kernel does not break it down."""
    sizes = _status()
    if "RssAnon" not in sizes:
        return sizes["VmRSS"]
    return sizes["RssAnon"] + sizes.get("VmSwap", 0)


class _AnonSampler:
    """The highest anonymous size seen, read every millisecond by a daemon thread until stopped."""

    def __init__(self) -> None:
        self.start = self.peak = _anon_bytes()
        self._stop, self._sampling = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-cap-sampler", daemon=True)
        self._thread.start()
        self._sampling.wait()  # its first reading (and the malloc arena it takes) comes before the cap

    def _run(self) -> None:
        self.peak = max(self.peak, _anon_bytes())
        self._sampling.set()
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _anon_bytes())

    def growth(self) -> int:
        """Stop sampling; the highest anonymous size seen above the start."""
        self._stop.set()
        self._thread.join()
        return max(self.peak, _anon_bytes()) - self.start


def _child(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
           cap_bytes: int) -> None:
    """The forked child: cap, run, report one message through ``conn``."""
    _reset_peak()
    start_rss = _status_bytes("VmRSS")
    sampler = _AnonSampler()
    try:
        _cap_address_space(cap_bytes)
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported
        bases = tuple(cls.__name__ for cls in type(exc).__mro__)
        message: tuple[Any, ...] = ("raised", type(exc).__name__, bases, "".join(traceback.format_exception(exc)))
        del exc  # drop the frames (and what they hold) before sending
    else:
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - an unpicklable result comes back as text
            value = repr(value)
        message = ("returned", value)
    conn.send(((_status_bytes("VmHWM") - start_rss, sampler.growth()), message))
    conn.close()


def run_capped(fn: Callable[..., Any], *args: Any, cap_bytes: int = DEFAULT_CAP_BYTES,
               timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> Outcome:
    """Run ``fn(*args, **kwargs)`` in a forked child under a memory cap and a timeout.

    Parameters
    ----------
    fn, args, kwargs
        The case. Any callable (closures too: the child is forked, nothing is pickled on the
        way in); what it returns must pickle to come back whole.
    cap_bytes
        How much the child's address space may grow past its size at the fork.
    timeout_s
        Seconds the child may run before it is killed.

    Returns
    -------
    Outcome
        ``returned`` / ``raised`` / ``killed`` / ``timed_out``, as the module docstring says.
    """
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args, kwargs, cap_bytes), daemon=True)
    proc.start()
    send.close()
    message = None
    try:
        timed_out = not receive.poll(timeout_s)
        if not timed_out:
            message = receive.recv()
    except EOFError:  # the child died before it could report
        pass
    finally:
        receive.close()
    if timed_out:
        proc.kill()
        proc.join()
        return Outcome("timed_out", exitcode=proc.exitcode)
    proc.join(timeout=10)
    if proc.is_alive():  # reported (or closed its end), then hung on its way out
        proc.kill()
        proc.join()
    if message is None:
        code = proc.exitcode
        return Outcome("killed", signal=-code if code is not None and code < 0 else None, exitcode=code)
    readings, message = message
    peak = {"peak_rss_growth": max(readings), "peak_readings": readings}
    if message[0] == "returned":
        return Outcome("returned", value=message[1], exitcode=proc.exitcode, **peak)
    _tag, name, bases, detail = message
    return Outcome("raised", error=name, error_bases=bases, detail=detail, exitcode=proc.exitcode, **peak)


#: What a fresh interpreter that imports torch and reads hostile files may use at most.
CHILD_PROCESS_CAP_BYTES = 8 << 30


def cap_address_space() -> None:
    """``preexec_fn`` for a fresh child interpreter (``subprocess.run(..., preexec_fn=...)``): its
    address space may grow by at most :data:`CHILD_PROCESS_CAP_BYTES`, so a case that allocates
    without bound fails with ``MemoryError`` in the child instead of taking the machine."""
    _cap_address_space(CHILD_PROCESS_CAP_BYTES)
