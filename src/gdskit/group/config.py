"""How a group load cuts its work and how long it waits for the other ranks.

>>> import gdskit.group
>>> with gdskit.group.options(window="256MiB", timeout=120):
...     pass  # group loads started in this context use these

A context variable, so a setting made in one thread (or asyncio task) does not reach
another. Every rank of a group must use the same ``window`` and ``piece`` sizes: they
shape the plan the ranks agree on (a mismatch is refused on every rank).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from gdskit.errors import InvalidArgumentError
from gdskit.group import plan
from gdskit.settings import parse_size


@dataclasses.dataclass(frozen=True)
class Options:
    """``window_bytes``: shared bytes per window (staging of at most two windows exists at once);
    ``piece_bytes``: largest piece of a large tensor; ``timeout_s``: the longest any rank waits
    for the others at one step (None: the process group's own timeout)."""

    window_bytes: int = plan.WINDOW_BYTES
    piece_bytes: int = plan.PIECE_BYTES
    timeout_s: float | None = None


_current: contextvars.ContextVar[Options] = contextvars.ContextVar("gdskit_group_options", default=Options())


def current() -> Options:
    """The options in force here."""
    return _current.get()


@contextlib.contextmanager
def options(*, window: int | str | None = None, piece: int | str | None = None,
            timeout: float | None = None) -> Iterator[Options]:
    """Use these options for the group loads started inside the ``with`` block.

    Parameters
    ----------
    window, piece : int or str, optional
        Sizes in bytes or as text (``"256MiB"``); unchanged where not given.
    timeout : float, optional
        Seconds; unchanged where not given.
    """
    now = _current.get()
    changes: dict[str, object] = {}
    for name, value in (("window_bytes", window), ("piece_bytes", piece)):
        if value is not None:
            size = parse_size(value)
            if size < 1:
                raise InvalidArgumentError(f"{name} must be at least one byte, got {value!r}")
            changes[name] = size
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
        changes["timeout_s"] = float(timeout)
    token = _current.set(dataclasses.replace(now, **changes))
    try:
        yield _current.get()
    finally:
        _current.reset(token)
