"""Calls in the background: :class:`Background`, a call a waiting thread may abandon, and
:class:`Branch`, a download started ahead of the state that needs it, overlapping other
work. (The agent process imports this module too: no logging, no store.)

When a run has extras to install, LoadPayload starts the code download (and the spilled
spec's) as branches, each in a thread of its own with a store handle of its own, and
InstallExtras installs meanwhile; without extras, FetchCode starts the spilled spec's
beside its own download. The machine keeps its eight states in their order, and each
state owns its join: FetchCode joins the code branch, ResolveSpec the spec branch
(Preload warms its models as branches too, and joins them itself). The outcome is the
serial one:

* a branch's failure is raised by the state that joins it, so the policy classifies it in
  that state, and only once the earlier states have succeeded: the earliest failing
  state's rule decides, as in a serial run;
* when a state fails, or a signal comes, the branches are cancelled: the flag that
  cancels them is their store handle's interrupt, which ends the waits between tries and
  stops a folder's download before its next file, so no download keeps running.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from fsm.clock import SLICE_S, wait_up_to
from fsm.errors import Interrupted
from fsm.interrupt import InterruptFlag

_T = TypeVar("_T")


class Background(Generic[_T]):
    """``fn()`` running in a daemon thread: a call the waiting thread may abandon (a
    daemon thread cannot keep the process alive). ``done`` is set when it ended."""

    def __init__(self, fn: Callable[[], _T], name: str) -> None:
        self._result: list[_T] = []
        self._error: list[BaseException] = []
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], _T]) -> None:
        try:
            self._result.append(fn())
        except BaseException as exc:  # handed to the waiting thread
            self._error.append(exc)
        finally:
            self.done.set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the call to end; True when it did. In short slices:
        between them the main thread runs the handler of a signal that another thread
        caught (``fsm.interrupt``), which one long wait would hold back until its end."""
        return wait_up_to(lambda timeout: self.done.wait(min(SLICE_S, timeout)), seconds)

    def result(self) -> _T:
        """The call's result, or its exception raised here (call once ``done`` is set)."""
        if self._error:
            raise self._error[0]
        return self._result[0]


class Branch(Background[_T]):
    """``work()`` running in a daemon thread; ``flag`` cancels it (the process's own
    interrupt flag triggers it too, see :meth:`follow`)."""

    def __init__(self, name: str, work: Callable[[], _T], flag: InterruptFlag) -> None:
        self.flag = flag
        super().__init__(work, f"prefetch-{name}")

    def cancel(self) -> None:
        """Stop the branch at its next file or try (idempotent)."""
        if not self.flag.is_set():
            self.flag.trigger(signal.SIGTERM)

    def join(self) -> _T:
        """The branch's result, or its failure raised here (in the joining state). A
        signal raised into the waiting thread (the driver's ``raise_on_interrupt``)
        cancels the branch on its way out."""
        try:
            wait_up_to(self.done.wait, math.inf)
        except (Interrupted, KeyboardInterrupt):
            self.cancel()
            raise
        return self.result()
