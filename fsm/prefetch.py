"""Downloads started ahead of the state that needs them, overlapping other work.

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

import signal
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from fsm.clock import os_timeout
from fsm.errors import Interrupted
from fsm.interrupt import InterruptFlag

_T = TypeVar("_T")

#: The wait slice of a join (an OS wait refuses very long timeouts).
_JOIN_SLICE_S = 3600.0


class Branch(Generic[_T]):
    """``work()`` running in a daemon thread; ``flag`` cancels it (the process's own
    interrupt flag triggers it too, see :meth:`follow`)."""

    def __init__(self, name: str, work: Callable[[], _T], flag: InterruptFlag) -> None:
        self.name = name
        self.flag = flag
        self.done = threading.Event()
        self._result: list[_T] = []
        self._error: list[BaseException] = []
        threading.Thread(target=self._run, args=(work,), name=f"prefetch-{name}",
                         daemon=True).start()

    def _run(self, work: Callable[[], _T]) -> None:
        try:
            self._result.append(work())
        except BaseException as exc:  # handed to the joining state, which classifies it
            self._error.append(exc)
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Stop the branch at its next file or try (idempotent)."""
        if not self.flag.is_set():
            self.flag.trigger(signal.SIGTERM)

    def join(self) -> _T:
        """The branch's result, or its failure raised here (in the joining state). A
        signal raised into the waiting thread (the driver's ``raise_on_interrupt``)
        cancels the branch on its way out."""
        try:
            while not self.done.wait(os_timeout(_JOIN_SLICE_S)):
                pass
        except (Interrupted, KeyboardInterrupt):
            self.cancel()
            raise
        if self._error:
            raise self._error[0]
        return self._result[0]
