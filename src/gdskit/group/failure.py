"""Every rank raises when one fails, within a timeout; none waits forever.

Three rules make that hold:

- every step a rank could fail in on its own (parsing, allocating, reading, copying,
  a progress callback) runs before an agreement: :func:`agree` tells all ranks who
  failed, and nobody issues the next collective after a failure;
- every collective is waited on with a deadline (``Work.wait(timeout=)``), so a rank
  that stopped answering (killed, stuck) makes the others raise when it passes;
- what torch.distributed raises (a lost connection, a timeout: ``RuntimeError``,
  ``DistBackendError``) becomes a :class:`~gdskit.errors.GroupError`.

The rank that failed raises its own error; the others raise ``GroupError`` naming it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gdskit.errors import GroupError

#: The shortest wait handed to a collective once a deadline has passed (it must still get a chance to finish).
_MIN_WAIT_S = 0.001


class Deadline:
    """A point in time ``timeout_s`` seconds from now."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(_MIN_WAIT_S, self._end - time.monotonic()))


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn the errors of torch.distributed calls inside the block into :class:`GroupError`."""
    try:
        yield
    except GroupError:
        raise
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo's "Connection closed by peer", timeouts
        raise GroupError(f"{what}: the process group failed ({type(exc).__name__}: {exc})") from exc


def wait(work: Any, deadline: Deadline, what: str) -> None:
    """Wait for the collective ``work`` until ``deadline``; :class:`GroupError` if it fails or times out."""
    with collective(what):
        if work.wait(timeout=deadline.remaining()) is False:  # backends that report a timeout instead of raising
            raise GroupError(f"{what}: no answer from every rank within {deadline.timeout_s:g} s")


def told(error: BaseException | None, tell: Callable[[], Any]) -> Any:
    """Run the collective ``tell`` (which tells the group of ``error``); then raise ``error`` on
    the rank that had it, its own failure saying more than the group's; else ``tell``'s answer."""
    try:
        answer = tell()
    except GroupError:
        if error is not None:
            raise error from None
        raise
    if error is not None:
        raise error
    return answer


def agree(failed_ranks: Callable[[bool], tuple[int, ...]], error: BaseException | None, what: str) -> None:
    """Tell the group whether this rank failed (``error``) and learn who did.

    Raises ``error`` on the rank that had it; :class:`GroupError` on the others when any rank
    failed. ``failed_ranks(flag)`` is the collective (:func:`gdskit.group.exchange.failed_ranks`).
    """
    failed = told(error, lambda: failed_ranks(error is not None))
    if failed:
        raise GroupError(f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of the process group "
                         f"failed {what}", failed)
