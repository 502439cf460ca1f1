"""The GPUs asked while the worker runs (CONTRACT section 8).

:class:`GpuWatch` is the supervision loop's host watch (``fsm.worker.supervise.Watch``):
every ``period_s`` (``FLASH_HOST_WATCH_S``) it takes one bounded snapshot in the background
(``fsm.host.gpus.start``: at most one at a time, never on the pump's path, never blocking the
loop), and when it is in compares it with the snapshot taken before the worker started
(``fsm.host.gpus.changed``). Only what the GPUs report stops the worker: a GPU missing from a
listing that answered, one nvidia-smi reports it cannot reach, new uncorrectable ECC
errors; and each only once a second look :data:`CONFIRM_S` later reports it again (a look
that answers without it clears it). A look that does not answer within its bound
(``FLASH_GPU_QUERY_S``), or fails without naming a GPU, is counted (:meth:`evidence`:
``looks``, ``unanswered``) and decides nothing: nvidia-smi is slow on healthy hosts.

:func:`hidden_by_env` says whether the job's own ``CUDA_VISIBLE_DEVICES`` names no GPU
the host has: then a console saying "No CUDA GPUs are available" is the job's doing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field

from fsm.host import gpus

__all__ = ["CONFIRM_S", "LOST_KINDS", "GpuWatch", "hidden_by_env", "watchable"]

#: While a snapshot is under way, the loop looks for its answer this often.
POLL_S = 0.25
#: How long after a look that reports a fault the second look starts.
CONFIRM_S = 5.0
#: The changes that are ``host-gpu-lost`` (a GPU out of reach or gone); new uncorrectable
#: ECC errors alone (``ecc-rose``) are ``host-gpu-unhealthy``.
LOST_KINDS = frozenset({"unreachable", "gone", "fewer"})

@dataclass(eq=False)
class GpuWatch:
    """The host watch of the supervision loop: see the module's docstring."""

    start: gpus.Snapshot
    environ: Mapping[str, str]
    period_s: float
    _: KW_ONLY
    query_s: float = gpus.DEFAULT_QUERY_S
    clock: Callable[[], float] = time.monotonic
    take: Callable[[Mapping[str, str], float], gpus.PendingSnapshot] = gpus.start
    #: What the GPUs reported on two looks when the watch said the host failed.
    verdict: gpus.Verdict | None = field(default=None, init=False)
    looks: int = field(default=0, init=False)
    #: Looks whose ``--query-gpu`` did not answer (hung at its bound, or failed).
    unanswered: int = field(default=0, init=False)
    _pending: gpus.PendingSnapshot | None = field(default=None, init=False)
    #: What the last answered look reported, waiting for a second look.
    _suspect: gpus.Verdict = field(default=gpus.Verdict(), init=False)

    def __post_init__(self) -> None:
        self.environ = dict(self.environ)  # as it was when the watch began
        self._next = self.clock() + self.period_s

    def due(self) -> float:
        return self._next

    def look(self) -> bool:
        """Start a look when one is due, or collect the one under way; True when a
        second look confirmed what the GPUs reported on the first."""
        now = self.clock()
        if self._pending is None and now < self._next:
            return False
        if self._pending is None:
            self._pending = self.take(self.environ, self.query_s)
        elif (snap := self._pending.result(0)) is not None:
            self._pending = None
            self.looks += 1
            return self._judge(snap, now)
        self._next = now + POLL_S  # a look started, or under way (it ends by its own bound)
        return False

    def _judge(self, snap: gpus.Snapshot, now: float) -> bool:
        if snap.problem is not None and not snap.lost:
            self.unanswered += 1  # silence: neither a fault nor its all-clear
        else:
            found = gpus.changed(self.start, snap)
            if again := _again(self._suspect, found):
                self.verdict = again
                return True
            self._suspect = found
        # a suspect is looked at again soon; else the next look is a period away
        self._next = now + (CONFIRM_S if self._suspect else self.period_s)
        return False

    def evidence(self) -> dict[str, int]:
        """``gpu_watch``: the looks taken, and how many of them did not answer."""
        return {"looks": self.looks, "unanswered": self.unanswered}


def _again(first: gpus.Verdict, second: gpus.Verdict) -> gpus.Verdict:
    """The findings of ``second`` that ``first`` reported too (the same kind of change of
    the same GPU): what two looks agree on."""
    seen = {_key(finding) for finding in first.findings}
    return gpus.Verdict(tuple(f for f in second.findings if _key(f) in seen))


def _key(finding: gpus.Finding) -> tuple[str, str | None, str | None, int | None]:
    """A GPU out of reach on one look and missing from the listing on the next is lost
    both times."""
    kind = "lost" if finding.kind in ("gone", "unreachable") else finding.kind
    return kind, finding.uuid, finding.bus_id, finding.index


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
    # CUDA reads the list up to its first invalid entry: whether the first names a GPU the
    # host has decides (an empty list, or ``-1``, names none)
    first = visible.split(",")[0].strip()
    if first.startswith("MIG-"):
        return False
    if first.lstrip("-").isdigit():
        return int(first) not in {gpu.index for gpu in start.gpus}
    return not (first.startswith("GPU-")
                and any(gpu.uuid and gpu.uuid.startswith(first) for gpu in start.gpus))
