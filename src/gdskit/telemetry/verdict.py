"""The path split of a ledger in plain words.

"posix" here means every storage byte that did not take a direct path (``cufile-nvfs``,
``cufile-p2pdma``): cuFile's compat mode, gdskit's bounce ring and the host path
all went through the CPU and the page cache or O_DIRECT. Bytes that arrived from
another rank of a process group (path ``peer``) moved no storage I/O here and count
on neither side.
"""

from __future__ import annotations

from gdskit.engine.ledger import Stats
from gdskit.vocabulary import is_direct_path, is_peer_path

NO_IO = "no gdskit I/O recorded"
ONLY_PEERS = "nothing read from storage: every byte came from other ranks"
ALL_DIRECT = "direct grew, posix flat"


def posix_reasons(stats: Stats) -> list[str]:
    """The reasons of the bytes that were not direct, most bytes first."""
    by_reason: dict[str, int] = {}
    for e in stats.entries:
        if not is_direct_path(e.path) and not is_peer_path(e.path):
            by_reason[e.reason] = by_reason.get(e.reason, 0) + e.bytes
    return [r for r, _ in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))]


def split(stats: Stats) -> tuple[int, int]:
    """(direct bytes, posix bytes), of the storage bytes."""
    return stats.direct_bytes, stats.storage_bytes - stats.direct_bytes


def verdict(stats: Stats) -> str:
    """``"direct grew, posix flat"``, ``"everything went through posix: <reasons>"``, a mix, or no I/O."""
    direct, posix = split(stats)
    if direct + posix == 0:
        return ONLY_PEERS if stats.peer_bytes else NO_IO
    if posix == 0:
        return ALL_DIRECT
    reasons = ", ".join(posix_reasons(stats)) or "unknown"
    if direct == 0:
        return f"everything went through posix: {reasons}"
    share = 100.0 * posix / (direct + posix)
    return f"direct grew, posix grew too: {share:.1f}% of the bytes were not direct: {reasons}"
