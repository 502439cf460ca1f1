"""Train: run the worker under the attempt's deadline, its console streamed and tailed,
its progress watched.

The worker's exit is a fact, not a verdict: after a signal too, VerifyRemote looks at the
store before anything is decided (a worker that uploaded DONE and metrics.json and was
then stopped with the host succeeded). The final console tail goes up with the marker.

A worker that makes no progress for ``FLASH_STALL_S`` (no console byte, no touch of
``FLASH_PROGRESS_FILE``) is stalled (CONTRACT section 7): its stacks are taken before the
first signal (``fsm.worker.stacks``), as they are when the deadline stops it, and ride with the
marker as ``stacks_<phase>.txt``; the state fires ``worker_stalled``, and VerifyRemote
judges the stall. The GPUs are asked every ``FLASH_HOST_WATCH_S`` too (``fsm.host.watch``,
CONTRACT section 8): a GPU nvidia-smi reports it cannot reach, one missing from a listing
that answered, or new uncorrectable ECC errors, each reported again on a second look,
stop the worker the same way (stacks first), and the state fires ``host_failed``; a look
that does not answer decides nothing.

No worker starts before the GPUs' verdict (``Context.settle_host``): setup overlapped
their answer, and a fault it reports ends the attempt here at the latest.

The attempt's lease (CONTRACT section 10) is written as the worker starts and renewed
while it runs (``fsm.worker.console.start_lease``). A later attempt of the run found under the
prefix kills the worker at once and ends the attempt ``superseded``, retriable, without
VerifyRemote: what is in the prefix now belongs to the later attempt.
"""

from __future__ import annotations

from functools import partial

from fsm import table
from fsm.context import SIGNAL_STOP_S, WORKER_ARGV, Context, GpuChange, StacksNote, Stall
from fsm.errors import DeadlineExceeded
from fsm.host.probe import memory_events_path, oom_kills
from fsm.host.watch import GpuWatch, watchable
from fsm.output.log import Progress
from fsm.prefetch import Background
from fsm.worker.console import PeriodicTail, console_path, progress_path, start_lease, superseded
from fsm.worker.supervise import StopReason, Watch, supervise

#: How long the end of training waits for a periodic tail upload in flight; it is fenced
#: (it can never land after the marker), so there is no reason to wait longer.
TAIL_CLOSE_S = 1.0

#: Of the time left before the worker must be gone, what stays for its SIGTERM's grace
#: when the stacks are taken at the deadline (the capture gets the rest, at most 20 s).
STOP_KEEP_S = 2.0
#: The stall evidence shows at most this much of the console's last line.
LAST_LINE_CHARS = 300


def train(ctx: Context) -> str:
    env = ctx.worker_env
    assert env is not None, "ResolveSpec builds the worker environment"
    ctx.settle_host(ctx.require_payload().expect_gpus)
    for stale in ("metrics.json", "train_meta.json", progress_path(ctx).name):
        (ctx.scratch / stale).unlink(missing_ok=True)
    tuning = ctx.tuning

    periodic = PeriodicTail(ctx) if tuning.upload_console else None
    oom_file = memory_events_path(ctx.environ)
    oom_before = oom_kills(oom_file)

    # The GPUs asked every FLASH_HOST_WATCH_S, compared with what they said before setup.
    host_watch = (GpuWatch(ctx.host_start, ctx.environ, tuning.host_watch_s,
                           query_s=tuning.gpu_query_s)
                  if tuning.host_watch_s > 0 and ctx.host_start is not None
                  and watchable(ctx.host_start) else None)

    watches: list[tuple[StopReason, Watch]] = [("host", host_watch)] if host_watch else []
    # The lease is written as the worker starts (CONTRACT section 10).
    lease = start_lease(ctx, table.TRAIN)
    if lease is not None:
        watches.append(("superseded", lease))

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
                stall_s=tuning.stall_s,
                progress_file=progress_path(ctx),
                before_stop=partial(_take_stacks, ctx),
                watches=watches,
            )
        progress.done(ok=result.reason == "exited", reason=result.reason)
    if periodic is not None:
        periodic.close(timeout_s=ctx.stop_deadline.bound(TAIL_CLOSE_S))
    if lease is not None:
        lease.stop(timeout_s=ctx.stop_deadline.bound(TAIL_CLOSE_S))
        ctx.evidence["lease"] = lease.evidence()
    if host_watch is not None:
        ctx.worker.gpu_watch = host_watch.evidence()
    ctx.worker.exit = result
    oom_after = oom_kills(oom_file)
    if oom_before is not None and oom_after is not None:
        # The kernel's OOM killer ended a process of this container while the worker ran.
        ctx.worker.oom_killed = oom_after > oom_before
    kept = ctx.worker.stacks.file if ctx.worker.stacks is not None else None
    if result.reason == "superseded":
        assert lease is not None and lease.superseded is not None
        raise superseded(lease.superseded)
    if result.reason == "deadline":
        raise DeadlineExceeded(
            "run wall deadline exceeded: the worker was stopped at the attempt deadline"
            + (f"; its stacks, taken first, are in {kept}" if kept else "")
        )
    if result.reason == "stalled":
        taken = ctx.worker.stacks
        ctx.worker.stall = Stall(
            silent_s=round(result.silent_s or 0.0, 1),
            last_line=_last_line(ctx),
            where=taken.detail.get("where") if taken is not None else None,
            where_in_code=taken.where_in_code if taken is not None else None,
        )
        return table.WORKER_STALLED
    if result.reason == "host":
        assert host_watch is not None and host_watch.verdict is not None
        ctx.worker.gpu_change = GpuChange("while the worker ran",
                                          host_watch.verdict.evidence(),
                                          host_watch.verdict.describe())
        return table.HOST_FAILED
    return table.WORKER_EXITED


def _take_stacks(ctx: Context, why: StopReason) -> None:
    """Before the stalled worker, or the one the deadline stops, gets its first signal: the
    stacks of every process of its group, bounded (at most 20 s, and at the deadline what
    the stop leaves), ended early by a signal to the runner (the host is going away). They
    go up with the marker as ``stacks_<phase>.txt``; the marker's ``stacks`` names the file."""
    from fsm.worker import procs, stacks  # only when a stop needs its evidence

    pgid = ctx.worker_pgid
    budget = min(stacks.BUDGET_S, ctx.stop_deadline.remaining() - STOP_KEEP_S)
    why_not = ("a signal came before they could be taken" if ctx.interrupt.is_set()
               else "no time left before the stop" if budget <= 0
               else "the worker's process group is gone" if pgid is None else None)
    if why_not is not None or pgid is None:
        ctx.worker.stacks = StacksNote(why_not=why_not)
        return
    setting = ctx.tuning.py_spy
    sampler: str | stacks._Find | None = (
        None if setting is not None and setting.lower() in ("none", "off", "0")
        else setting if setting is not None else stacks.FIND)
    code_dir = ctx.settings.code_root / "code"
    call = Background(lambda: stacks.capture(
        procs.group_members(pgid), leader=pgid, code_dir=code_dir, redact=ctx.redactor.text,
        budget_s=budget, py_spy=sampler), "flash-stacks")
    # In slices (a signal's handler runs between them): a SIGTERM cuts the capture short.
    while not call.wait(0.1):
        if ctx.interrupt.is_set():
            ctx.worker.stacks = StacksNote(why_not="a signal came while taking them")
            return
    taken = call.result()
    name = stacks.artifact_name(ctx.require_payload().phase or "worker")
    ctx.end_artifacts[name] = taken.text
    ctx.worker.stacks = StacksNote(file=name, taken_for=why, where_in_code=taken.where_in_code,
                                   detail=taken.evidence())


def _last_line(ctx: Context) -> str:
    """The console's last line with text on it, redacted, shortened (the stall evidence)."""
    try:
        tail = ctx.redactor.tail_of(console_path(ctx), 8192).decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()
             and not line.startswith("--- flash-bootstrap:")]  # not the runner's cap line
    return lines[-1][-LAST_LINE_CHARS:] if lines else ""


def _so_far(ctx: Context) -> dict[str, int]:
    """The worker's progress: its console's bytes so far, the seconds it has left."""
    return {"bytes": console_path(ctx).stat().st_size,
            "seconds_left": max(0, round(ctx.work_deadline.remaining()))}
