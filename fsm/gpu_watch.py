"""The GPUs asked while the worker runs, and after it died (CONTRACT section 8, issue 24).

:class:`GpuWatch` is the supervision loop's host watch (``fsm.supervise.HostWatch``):
every ``period_s`` (``FLASH_HOST_WATCH_S``) it takes one bounded snapshot in the background
(``fsm.gpus.start``: at most one at a time, never on the pump's path, never blocking the
loop), and when it is in compares it with the snapshot taken before setup
(``fsm.gpus.changed``). A GPU that can no longer be reached (nvidia-smi failing for it, or
hung past its 2 s bound, which counts only once that bound is over), fewer GPUs than at
the start, or uncorrectable ECC errors that rose, and the watch says the host failed: the
worker is stopped (its stacks first) and the attempt ends retriable.

:func:`hidden_by_env` says whether the job's own ``CUDA_VISIBLE_DEVICES`` names no GPU
the host has: then a console saying "No CUDA GPUs are available" is the job's doing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from fsm import gpus

__all__ = ["LOST_KINDS", "GpuWatch", "hidden_by_env", "watchable"]

#: While a snapshot is under way, the loop looks for its answer this often.
POLL_S = 0.25
#: What a change from the start must be to stop the worker: a GPU out of reach or gone,
#: and new uncorrectable ECC errors (``ecc-rose``); the rest are ``host-gpu-lost``.
LOST_KINDS = frozenset({"unanswered", "unreachable", "gone", "fewer"})


class GpuWatch:
    """The host watch of the supervision loop: see the module's docstring."""

    def __init__(
        self,
        start: gpus.Snapshot,
        environ: Mapping[str, str],
        period_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        take: Callable[[Mapping[str, str]], gpus.PendingSnapshot] = gpus.start,
    ) -> None:
        self.start = start
        self.period_s = period_s
        #: What changed when the watch said the host failed (None until then).
        self.verdict: gpus.Verdict | None = None
        self.looks = 0
        self._environ = dict(environ)
        self._clock = clock
        self._take = take
        self._pending: gpus.PendingSnapshot | None = None
        self._next = clock() + period_s

    def due(self) -> float:
        return self._next

    def look(self) -> bool:
        now = self._clock()
        if self._pending is None:
            if now < self._next:
                return False
            self._pending = self._take(self._environ)
            self._next = now + POLL_S
            return False
        snap = self._pending.result(0)
        if snap is None:  # still under way (it ends by its own bound)
            self._next = now + POLL_S
            return False
        self._pending = None
        self._next = now + self.period_s
        self.looks += 1
        verdict = gpus.changed(self.start, snap)
        if verdict:
            self.verdict = verdict
            return True
        return False


def watchable(start: gpus.Snapshot | None) -> bool:
    """Whether a snapshot taken before setup can be compared with later ones: nvidia-smi
    answered then, and listed GPUs."""
    return start is not None and start.problem is None and bool(start.gpus)


def hidden_by_env(start: gpus.Snapshot | None, visible: str | None) -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` (the job's, as given) names no GPU the host has: an
    empty list, ``-1``, or only indices and UUIDs the host does not list. Unknown (no
    snapshot of the host's GPUs, a MIG device id) is False: then it explains nothing."""
    if visible is None or start is None or start.problem is not None or not start.gpus:
        return False
    entries = [entry.strip() for entry in visible.split(",")]
    if entries == [""]:
        return True
    uuids = [gpu.uuid for gpu in start.gpus if gpu.uuid]
    indices = {gpu.index for gpu in start.gpus if gpu.index is not None}
    for entry in entries:  # CUDA reads the list up to its first invalid entry
        if entry.startswith("MIG-"):
            return False
        if entry.lstrip("-").isdigit():
            number = int(entry)
            if number < 0:
                break  # CUDA stops at the first invalid entry: the rest is not seen
            if number in indices:
                return False
            break
        if entry.startswith("GPU-") and any(uuid.startswith(entry) for uuid in uuids):
            return False
        break
    return True
