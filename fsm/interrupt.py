"""SIGTERM/SIGINT as a flag the whole runner can look at.

The runner installs its own handlers (as PID 1 of a container a signal without a handler
is ignored). A signal sets the flag and calls the listeners, so a supervisor waiting on
the worker wakes at once; handlers that are interruptible get ``Interrupted`` raised in
the main thread.

``trigger`` runs inside a signal handler, on the main thread, between two bytecodes of
whatever the main thread was doing, so it takes no lock the main thread could be holding:
setting the flag is a plain assignment, and listeners must be signal-safe themselves
(write a byte to a pipe, not ``Event.set``).
"""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[[int], None]


class InterruptFlag:
    """Set by the first SIGTERM/SIGINT; remembers which signal it was."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._listeners: tuple[Listener, ...] = ()

    def is_set(self) -> bool:
        return self.signum is not None

    def trigger(self, signum: int) -> None:
        """Record the signal and notify every listener (signal-safe)."""
        if self.signum is None:
            self.signum = signum
        for listener in self._listeners:  # a snapshot: the tuple is replaced, never mutated
            listener(signum)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(signum)`` on every trigger; returns the function that unsubscribes."""
        self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe
