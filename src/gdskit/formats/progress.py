"""Progress of a checkpoint load or save: a terminal bar for long loads, a callback for programs."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Union

#: ``callback(bytes_done, bytes_total)``; called from I/O threads, keep it quick.
ProgressCallback = Callable[[int, int], None]
ProgressArg = Union[bool, ProgressCallback, None]

#: An automatic bar appears only once a load has run this long.
BAR_DELAY_S = 2.0


class Progress:
    """Counts bytes done and reports them.

    Parameters
    ----------
    total : int
        Bytes the whole operation moves.
    progress : bool, callable or None
        None: a bar on stderr if it is a terminal and the operation takes over
        :data:`BAR_DELAY_S`; True: always a bar; False: nothing; a callable is
        called with ``(bytes_done, bytes_total)`` after every completed read or write.
    """

    def __init__(self, total: int, progress: ProgressArg = None, label: str = "loading") -> None:
        self.total = total
        self.done = 0
        self._lock = threading.Lock()
        self._callback = progress if callable(progress) else None
        self._want_bar = progress is True or (progress is None and _is_terminal())
        self._delay = 0.0 if progress is True else BAR_DELAY_S
        self._label = label
        self._start = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            done = self.done
            if self._want_bar and self._bar is None and time.monotonic() - self._start >= self._delay:
                self._open_bar()
            if self._bar is not None:
                self._bar.update(self._task, completed=done)
        if self._callback is not None:
            self._callback(done, self.total)

    def _open_bar(self) -> None:
        try:
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress,
                                       TextColumn, TimeRemainingColumn, TransferSpeedColumn)  # noqa: PLC0415 - import time
            from rich.console import Console  # noqa: PLC0415 - import time
        except ImportError:
            self._want_bar = False
            return
        self._bar = RichProgress(TextColumn(self._label), BarColumn(), DownloadColumn(binary_units=True),
                                 TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(self._label, total=self.total)
        self._bar.start()

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
