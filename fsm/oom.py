"""The OOM killer pointed at the worker, never at the runner.

A supervised process is started with ``oom_score_adj`` :data:`CHILD_OOM_SCORE_ADJ`
(raising needs no privilege, and every descendant inherits it), and the runner (and its
``huggingface_hub`` process, ``fsm.hub.agent``) lowers its own to
:data:`RUNNER_OOM_SCORE_ADJ` where it is permitted (``CAP_SYS_RESOURCE``): an OOM in the
container ends the worker (``worker-oom-killed`` names it), not the runner.

Standard library only, and nothing heavy: the Hub's process lowers its score first thing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["CHILD_OOM_SCORE_ADJ", "RUNNER_OOM_SCORE_ADJ", "lower_own_oom_score", "oom_first"]

#: The supervised processes' ``oom_score_adj``: the kernel's first choice.
CHILD_OOM_SCORE_ADJ = 1000
#: The runner's own, where it may lower it: killable only when nothing else is left.
RUNNER_OOM_SCORE_ADJ = -900
_OOM_ADJ = "/proc/self/oom_score_adj"


def _read_adj() -> int | None:
    try:
        with open(_OOM_ADJ, "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _write_adj(value: int) -> bool:
    try:
        with open(_OOM_ADJ, "wb") as f:
            f.write(str(value).encode())
        return True
    except OSError:
        return False


def lower_own_oom_score() -> bool:
    """Lower this process's ``oom_score_adj`` where permitted (``CAP_SYS_RESOURCE``)."""
    current = _read_adj()
    if current is None or current <= RUNNER_OOM_SCORE_ADJ:
        return current is not None
    return _write_adj(RUNNER_OOM_SCORE_ADJ)


@contextlib.contextmanager
def oom_first() -> Iterator[None]:
    """Within this block, processes this one starts inherit ``oom_score_adj``
    :data:`CHILD_OOM_SCORE_ADJ` (this process holds it meanwhile, and goes back after:
    going back down to where it was needs no privilege, the kernel's floor being what a
    privileged writer last set)."""
    before = _read_adj()
    raised = before is not None and before < CHILD_OOM_SCORE_ADJ and _write_adj(
        CHILD_OOM_SCORE_ADJ)
    try:
        yield
    finally:
        if raised and before is not None:
            _write_adj(before)
