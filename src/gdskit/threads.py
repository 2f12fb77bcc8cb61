"""Every thread gdskit starts, started one way: with the process's signals left to the main thread.

A signal sent to a process (Ctrl-C's SIGINT, a scheduler's SIGTERM) goes to any one of its
threads that does not block it. Python runs its handlers only in the main thread, and a
blocking call there (``time.sleep``, ``Popen.wait``, a lock) is interrupted only when the
signal lands on the main thread itself. Landed on a gdskit worker instead, a Ctrl-C would wait
until the main thread next ran Python: after a 60-second sleep, or never. So gdskit's threads
block those signals before they run anything; threads they start (the CUDA driver's own among
them) inherit the mask.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: The asynchronous signals a process receives from outside (terminal, scheduler, parent,
#: timers). Faults (SIGSEGV, SIGBUS, SIGFPE, ...) and SIGPIPE go to the thread that caused them
#: and are never blocked.
PROCESS_SIGNALS: frozenset[int] = frozenset(
    getattr(signal, name) for name in (
        "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM",
        "SIGPROF", "SIGCHLD", "SIGWINCH", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGXCPU", "SIGXFSZ",
        "SIGIO", "SIGURG", "SIGPWR")
    if hasattr(signal, name))


def leave_signals_to_main() -> None:
    """Block :data:`PROCESS_SIGNALS` in the calling thread (never in the main thread)."""
    if threading.current_thread() is threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, PROCESS_SIGNALS)


def take_signals_back() -> None:
    """Unblock :data:`PROCESS_SIGNALS` in the calling thread: the first thing a process gdskit
    starts does (a reader, a benchmark worker). A child inherits the signal mask of the thread
    that started it, and one started from a gdskit thread would otherwise never see SIGTERM."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PROCESS_SIGNALS)


def start_thread(target: Callable[[], Any], name: str, *, daemon: bool = True) -> threading.Thread:
    """Start ``target`` on a new thread named ``name`` that leaves the process's signals to the
    main thread."""
    def run() -> None:
        leave_signals_to_main()
        target()

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def executor(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads (named ``name_N``) leave the process's signals to the main thread."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                              initializer=leave_signals_to_main)
