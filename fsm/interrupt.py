"""The stop signals as a flag the whole runner can look at, and the table that says what
the runner does with every signal whose default action would end it.

The runner installs its own handlers (as PID 1 of a container a signal without a handler
is ignored; behind an init, a shell or run by hand the default action ends the process
with no marker while the worker trains on, orphaned). A stop signal (:data:`STOP_SIGNALS`)
sets the flag and calls the listeners, so a supervisor waiting on the worker wakes at
once; handlers that are interruptible get ``Interrupted`` raised in the main thread. A
signal of :data:`IGNORED_SIGNALS` is caught and counted, nothing more: no one who sends it
means "stop the attempt", and a handler (unlike ``SIG_IGN``) is reset at ``exec``, so the
worker still gets the default action. The documented whole, every signal whose default
action ends the process and why, is the table of docs/container.md ("Every signal").

``trigger`` runs inside a signal handler, on the main thread, between two bytecodes of
whatever the main thread was doing, so it takes no lock the main thread could be holding:
setting the flag is a plain assignment, and listeners must be signal-safe themselves
(write a byte to a pipe, not ``Event.set``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

Listener = Callable[[int], None]

#: Stopped like SIGTERM: the flag is set and the attempt ends ``interrupted`` (retriable).
STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPWR, signal.SIGXCPU,
)
#: Caught and counted, nothing else: the attempt goes on.
IGNORED_SIGNALS: tuple[int, ...] = (
    signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF,
    signal.SIGIO, signal.SIGSTKFLT, *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
)

#: How many of each ignored signal arrived (signal number -> count); read for evidence.
IGNORED_COUNTS: dict[int, int] = {}


def _ignore(signum: int, _frame: object) -> None:
    IGNORED_COUNTS[signum] = IGNORED_COUNTS.get(signum, 0) + 1


def ignored_evidence() -> dict[str, int]:
    """The ignored signals that arrived, by name, with their counts."""
    counts = dict(IGNORED_COUNTS)  # a copy: a handler may add to it meanwhile
    return {_name(sig): n for sig, n in sorted(counts.items())}


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal past SIGRTMIN has no name of its own
        return f"SIGRTMIN+{sig - signal.SIGRTMIN}"


def install_ignored() -> None:
    """Catch every signal of :data:`IGNORED_SIGNALS` with a handler that only counts it."""
    for sig in IGNORED_SIGNALS:
        with contextlib.suppress(OSError, ValueError):  # a platform without this signal
            signal.signal(sig, _ignore)


class InterruptFlag:
    """Set by the first SIGTERM/SIGINT; remembers which signal it was."""

    def __init__(self) -> None:
        self.signum: int | None = None
        #: ``time.monotonic()`` when the first signal arrived (the stop budget counts from it)
        self.at_mono: float | None = None
        self._listeners: tuple[Listener, ...] = ()

    def is_set(self) -> bool:
        return self.signum is not None

    def trigger(self, signum: int) -> None:
        """Record the signal and notify every listener (signal-safe)."""
        if self.signum is None:
            self.at_mono = time.monotonic()
            self.signum = signum
        for listener in self._listeners:  # a snapshot: the tuple is replaced, never mutated
            listener(signum)

    def follower(self) -> InterruptFlag:
        """A flag of its own that this one triggers too (signal-safe): a cancel of part of
        the work (a prefetch branch, setup) that every stop signal also cancels."""
        flag = InterruptFlag()
        self.subscribe(flag.trigger)  # signal-safe: trigger only assigns and calls
        if self.signum is not None:
            flag.trigger(self.signum)
        return flag

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(signum)`` on every trigger; returns the function that unsubscribes."""
        self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe


# --- waking the main thread -------------------------------------------------------------
#
# A signal sent to the process is caught by whichever thread the kernel picks; Python runs
# the handler later, on the main thread, at its next bytecode. A main thread blocked in a
# system call is not woken when another thread caught the signal (strace shows its poll
# restarted, not interrupted), so the handler would wait until that call ends by itself:
# a SIGTERM could go unseen for as long as the worker runs. With a wakeup descriptor armed
# (``signal.set_wakeup_fd``), whichever thread catches a signal writes its number there;
# the main thread's waits on descriptors include it, wake, and run the handler at once.
# Waits that cannot include a descriptor wait in short slices instead (``fsm.budget``).

_wakeup: tuple[int, int, int] | None = None  # (read end, write end, the fd it replaced)


def arm_wakeup() -> None:
    """Arm the process's wakeup descriptor (main thread only; idempotent)."""
    global _wakeup
    if _wakeup is not None:
        return
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: nothing to wake
        os.close(r)
        os.close(w)
        return
    _wakeup = (r, w, previous)


def disarm_wakeup() -> None:
    """Put back the wakeup descriptor that was there before :func:`arm_wakeup`."""
    global _wakeup
    if _wakeup is None:
        return
    r, w, previous = _wakeup
    _wakeup = None
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(previous)
    for fd in (r, w):
        with contextlib.suppress(OSError):
            os.close(fd)


def wakeup_fd() -> int | None:
    """The descriptor that turns readable when any thread caught a signal, if armed."""
    return _wakeup[0] if _wakeup is not None else None


#: The process's one flag. ``install_early`` points the stop signals at it as the first thing
#: ``flash-bootstrap run`` does, before any heavy import, so a signal during start-up is
#: remembered (and ends in a retriable marker once the destination is known) instead of
#: killing the process with nothing written.
PROCESS_FLAG = InterruptFlag()


def install_early() -> None:
    """Route the stop signals to :data:`PROCESS_FLAG` (the runner installs its own handler
    later) and catch the ignored ones, so that none of the table's signals ends the
    process. The wakeup descriptor is not armed here: the caller arms it once it may open
    one (:func:`arm_wakeup`)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: PROCESS_FLAG.trigger(signum))
    install_ignored()
