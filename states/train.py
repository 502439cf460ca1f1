"""Train: run the worker under the attempt's deadline, its console streamed and tailed.

The worker's exit is a fact, not a verdict: after a signal too, VerifyRemote looks at the
store before anything is decided (a worker that uploaded DONE and metrics.json and was
then stopped with the host succeeded). The final console tail goes up with the marker.
"""

from __future__ import annotations

import contextlib
import signal
from functools import partial

from fsm import table
from fsm.console import PeriodicTail, console_path
from fsm.context import SIGNAL_STOP_S, Context
from fsm.errors import DeadlineExceeded
from fsm.host import memory_events_path, oom_kills
from fsm.log import Progress
from fsm.supervise import supervise

#: How long the end of training waits for a periodic tail upload in flight; it is fenced
#: (it can never land after the marker), so there is no reason to wait longer.
TAIL_CLOSE_S = 1.0

WORKER_ARGV = ("-m", "flash.engine.worker")


def train(ctx: Context) -> str:
    env = ctx.worker_env
    assert env is not None, "ResolveSpec builds the worker environment"
    for stale in ("metrics.json", "train_meta.json"):
        with contextlib.suppress(FileNotFoundError):
            (ctx.scratch / stale).unlink()
    tuning = ctx.tuning

    periodic = PeriodicTail(ctx) if tuning.upload_console else None
    oom_file = memory_events_path(ctx.environ)
    oom_before = oom_kills(oom_file)

    # worker.progress: its console's bytes so far, and the seconds left before the deadline
    left = max(0, round(ctx.work_deadline.remaining()))
    with ctx.interrupts_handled(), Progress("worker", seconds_left=left) as progress:
        with progress.watch(partial(_so_far, ctx)):
            result = supervise(
                [ctx.python, *WORKER_ARGV],
                cwd=ctx.settings.code_root / "code",
                env=env,
                console_path=console_path(ctx),
                deadline=ctx.work_deadline,
                stop_by=ctx.stop_deadline,
                interrupt=ctx.interrupt,
                grace_s=tuning.stop_grace_s,
                signal_stop_s=SIGNAL_STOP_S,
                out_fd=ctx.out,
                tail_sink=periodic,
                tail_interval_s=tuning.console_upload_interval_s,
                on_group=lambda pgid: setattr(ctx, "worker_pgid", pgid),  # for the watchdog
            )
        progress.done(ok=result.reason == "exited", reason=result.reason)
    if periodic is not None:
        periodic.close(timeout_s=ctx.stop_deadline.bound(TAIL_CLOSE_S))
    ctx.evidence["worker"] = {
        "exit_code": result.returncode,
        "signal": signal.Signals(result.signal).name if result.signal else None,
        "reason": result.reason,
        "seconds": round(result.duration_s, 3),
    }
    oom_after = oom_kills(oom_file)
    if oom_before is not None and oom_after is not None:
        # The kernel's OOM killer ended a process of this container while the worker ran.
        ctx.evidence["worker"]["oom_killed"] = oom_after > oom_before
    ctx.worker_result = result
    if result.reason == "deadline":
        raise DeadlineExceeded(
            "run wall deadline exceeded: the worker was stopped at the attempt deadline"
        )
    return table.WORKER_EXITED


def _so_far(ctx: Context) -> dict[str, int]:
    """The worker's progress: its console's bytes so far, the seconds it has left."""
    return {"bytes": console_path(ctx).stat().st_size,
            "seconds_left": max(0, round(ctx.work_deadline.remaining()))}
