"""The process's exit, in order.

Python runs ``atexit`` hooks last-registered first, so hooks registered by whichever module
happened to import last would decide the order: the cuFile driver could close while a worker
thread was still inside a cuFile call, or pinned memory be freed while a copy read it. Every
part of gdskit that holds something at exit registers here instead, under one of three
stages that always run in this order:

1. ``STOP_WORK``: no new work; worker threads and background set-up finish and are joined.
2. ``CLOSE_DRIVERS``: cuFile handles and buffers deregistered, the driver closed.
3. ``FREE_MEMORY``: pinned staging and streams released while CUDA still runs.

After that, :func:`exiting` is True and the last-resort finalizers of CUDA objects do
nothing: the interpreter is tearing its modules down, and the process's exit returns the
memory anyway.
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

STOP_WORK, CLOSE_DRIVERS, FREE_MEMORY = 0, 1, 2
_STAGES = (STOP_WORK, CLOSE_DRIVERS, FREE_MEMORY)

_lock = threading.Lock()
_hooks: dict[int, list[Callable[[], None]]] = {stage: [] for stage in _STAGES}
_done = False


def at_exit(stage: int, hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit in ``stage``; within a stage the last registered runs first."""
    if stage not in _hooks:
        raise ValueError(f"unknown exit stage {stage!r}")
    with _lock:
        if hook not in _hooks[stage]:
            _hooks[stage].append(hook)


class ClosedAtExit:
    """Objects held weakly and each closed at exit in ``stage`` by ``close(obj)`` (its errors
    ignored: the exiting process returns the rest); the exit hook is registered with the first."""

    def __init__(self, stage: int, close: Callable[[Any], None]) -> None:
        if stage not in _hooks:
            raise ValueError(f"unknown exit stage {stage!r}")
        self._stage, self._close = stage, close
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._hooked = False

    def add(self, obj: Any) -> None:
        with self._lock:
            self._live.add(obj)
            first, self._hooked = not self._hooked, True
        if first:
            at_exit(self._stage, self.close_all)

    def close_all(self) -> None:
        with self._lock:
            objs = list(self._live)
        for obj in objs:
            try:
                self._close(obj)
            except Exception:  # noqa: BLE001 - one failing object must not keep the rest from closing
                pass


def exiting() -> bool:
    """Whether the ordered exit has run (or the interpreter is finalizing)."""
    return _done or sys.is_finalizing()


def run() -> None:
    """The ordered exit (registered with ``atexit``; safe to call more than once)."""
    global _done
    for stage in _STAGES:
        with _lock:
            hooks = list(reversed(_hooks[stage]))
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one failing part must not keep the rest from closing
                pass
    _done = True


atexit.register(run)
