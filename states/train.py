"""Train: run the worker under the attempt's deadline, its console streamed and tailed."""

from __future__ import annotations

import contextlib
import signal

from fsm import table
from fsm.console import PeriodicTail, console_path, upload_tail
from fsm.context import Context
from fsm.errors import DeadlineExceeded, Interrupted
from fsm.supervise import supervise

WORKER_ARGV = ("-m", "flash.engine.worker")


def train(ctx: Context) -> str:
    env = ctx.worker_env
    assert env is not None, "ResolveSpec builds the worker environment"
    for stale in ("metrics.json", "train_meta.json"):
        with contextlib.suppress(FileNotFoundError):
            (ctx.scratch / stale).unlink()
    tuning = ctx.tuning

    periodic = PeriodicTail(ctx) if tuning.upload_console else None
    with ctx.interrupts_handled():
        result = supervise(
            [ctx.python, *WORKER_ARGV],
            cwd=ctx.settings.code_root / "code",
            env=env,
            console_path=console_path(ctx),
            deadline=ctx.work_deadline,
            stop_by=ctx.stop_deadline,
            interrupt=ctx.interrupt,
            grace_s=tuning.stop_grace_s,
            out_fd=ctx.out_fd,
            tail_sink=periodic,
            tail_interval_s=tuning.console_upload_interval_s,
            on_group=lambda pgid: setattr(ctx, "worker_pgid", pgid),  # for the watchdog
        )
    if periodic is not None:
        periodic.close(timeout_s=ctx.stop_deadline.bound(30.0))
    ctx.evidence["worker"] = {
        "exit_code": result.returncode,
        "signal": signal.Signals(result.signal).name if result.signal else None,
        "reason": result.reason,
        "seconds": round(result.duration_s, 3),
    }
    ctx.worker_result = result
    if result.reason == "interrupted":
        upload_tail(ctx)
        raise Interrupted(ctx.interrupt.signum or signal.SIGTERM)
    if result.reason == "deadline":
        upload_tail(ctx)  # the supervisor appended the cap line to the console
        raise DeadlineExceeded(
            "run wall deadline exceeded: the worker was stopped at the attempt deadline"
        )
    if result.returncode != 0 or tuning.upload_console:
        upload_tail(ctx)
    return table.WORKER_EXITED
