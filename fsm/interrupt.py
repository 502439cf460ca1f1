"""SIGTERM/SIGINT as a flag the whole runner can wait on.

The runner installs its own handlers (as PID 1 of a container a signal without a handler
is ignored). A signal sets the flag and calls the listeners, so a supervisor waiting on
the worker wakes at once; handlers that are interruptible get ``Interrupted`` raised in
the main thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Listener = Callable[[int], None]


class InterruptFlag:
    """Set once by the first SIGTERM/SIGINT; remembers which signal it was."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.RLock()  # re-entrant: a signal may land inside subscribe()
        self._listeners: list[Listener] = []
        self.signum: int | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def trigger(self, signum: int) -> None:
        """Record the signal and notify every listener (safe from a signal handler)."""
        with self._lock:
            if self.signum is None:
                self.signum = signum
            self._event.set()
            listeners = list(self._listeners)
        for listener in listeners:
            listener(signum)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(signum)`` on every trigger; returns the function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe
