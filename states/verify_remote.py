"""VerifyRemote: the worker's exit code proves nothing; its artifacts in the store do.

Success iff ``DONE`` and ``metrics.json`` are confirmed in the store, whatever the exit
code (a library may crash at interpreter exit after both uploads). Otherwise the policy
judges the evidence (``policy.judge_worker``): the worker's own retriable heartbeat, a lost
upload, a kernel OOM kill, then the console's last lines (a host fault is retried on a
fresh host; the job's own fault fails the run).

Runs in the end of the attempt's own budget (``fsm.context.End``: at most its first half,
each store call sized so that several tries fit), and after a signal too, within a short
bound (``SIGNAL_VERIFY_S``): confirmed completion outranks a late SIGTERM. Without it, a
worker the signal stopped makes the attempt ``interrupted``; a worker that had exited on its
own before the signal is judged by its own exit.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

from fsm import policy, rules, table
from fsm.attempt import marker
from fsm.context import Context, GpuChange
from fsm.errors import (
    DeadlineExceeded,
    FatalError,
    Interrupted,
    RetriableError,
    StoreNotFound,
    StoreUnavailable,
)
from fsm.files import JsonProblem, json_object
from fsm.host import gpus, storage
from fsm.host.watch import LOST_KINDS, hidden_by_env, watchable
from fsm.payload import Payload
from fsm.worker.console import console_path
from fsm.worker.files import heartbeat_says_retriable
from fsm.worker.supervise import TAIL_BYTES

COMPLETION_ARTIFACTS = ("DONE", "metrics.json")
HEARTBEAT = "heartbeat.json"
MIB = 1 << 20


def verify_remote(ctx: Context) -> str:
    p = ctx.require_payload()
    end = ctx.begin_end()  # the end of the attempt starts here: its budget is its own
    # A signal does not cut the look at the store short (its answer outranks the signal);
    # it bounds it: SIGNAL_VERIFY_S after the signal (less what the marker must keep) the
    # attempt is marked interrupted.
    with ctx.interrupts_handled():
        try:
            present, heartbeat_retriable = ctx.run_past_signal(
                lambda: _look(ctx, p), until_s=end.signal_verify_s()
            )
        except (StoreUnavailable, DeadlineExceeded) as exc:
            # Out of tries, or out of verification's share of the end: the store could not
            # be read in time (the attempt's own deadline is Mark's to meet).
            raise RetriableError(
                f"could not read the store to verify the worker's completion: {exc}",
                rule=rules.VERIFY_UNREADABLE,
            ) from exc
    if all(present.values()):
        return table.COMPLETION_CONFIRMED

    ended = ctx.worker.exit.reason if ctx.worker.exit is not None else None
    # A worker's own exit stands after a signal; so does a stall called before any signal
    # came, and a stop for the host's GPUs (the host watch), which decides by itself.
    if ctx.interrupt.is_set() and ended not in ("exited", "stalled", "host"):
        raise Interrupted(ctx.interrupt.signum or 15)
    missing = ", ".join(name for name, ok in present.items() if not ok)
    if ended == "host":
        raise _host_failed(ctx, p, missing)
    facts = policy.WorkerFacts(
        stalled=ended == "stalled",
        heartbeat_retriable=heartbeat_retriable,
        upload_lost=(ctx.scratch / "metrics.json").is_file(),
        oom_killed=ctx.worker.oom_killed is True,
        console=_console_tail(ctx),
        env_hides_gpus=hidden_by_env(ctx.host_start, p.env.get("CUDA_VISIBLE_DEVICES")),
        disk_short_at_start=any(storage.came_short(fs, storage.floor(ctx.merged_env()))
                                for fs in ctx.storage_start.values()),
        **_gpus_since_start(ctx),
    )
    rule, match = policy.judge_worker(facts)
    rule = _across_attempts(ctx, p, rule, match, facts)
    if match is not None:
        ctx.evidence["host_fault" if rule.retriable else "job_fault"] = match.evidence()
        _space_evidence(ctx, match.signature.id)
    error = RetriableError if rule.retriable else FatalError
    raise error(
        f"{_reason(ctx, p, rule, match, missing)}; see error_{p.phase}.txt and "
        f"console_{p.phase}.txt in the store",
        rule=rule,
        stands_after_signal=ended in ("exited", "stalled"),
    )


def _reason(
    ctx: Context, p: Payload, rule: rules.Rule, match: policy.ConsoleMatch | None, missing: str
) -> str:
    """Why the worker's attempt failed, in the words an engineer on call needs."""
    exited = _exit_text(ctx)
    if rule in (rules.WORKER_STALLED, rules.WORKER_STALLED_AGAIN):
        return _stall_reason(ctx, p, rule, missing)
    if rule is rules.FAULT_FOLLOWS_JOB:
        before = ctx.evidence.get("previous_attempt", {})
        what = (f"{match.signature.meaning} ({match.signature.id}): {match.line}"
                if match is not None
                else f"the same failure ({ctx.judged_fault.family if ctx.judged_fault else '-'})")
        return (f"the fault followed the job: attempt {before.get('attempt')} failed the same "
                f"way on another host, so it is the job's, not a host's: {what}; worker "
                f"{exited} without {missing}")
    change = ctx.worker.gpu_change
    if rule is rules.WORKER_HOST_FAULT and match is None and change is not None:
        return (f"host fault, retry on a fresh host: the GPUs changed since the start: "
                f"{change.text}; worker {exited} without {missing}")
    if rule is rules.WORKER_HEARTBEAT_RETRIABLE:
        return (f"worker {exited} without {missing} in the store; its heartbeat for attempt "
                f"{p.dest.attempt} says retriable")
    if rule is rules.WORKER_UPLOAD_LOST:
        return (f"worker {exited} and wrote metrics.json locally, but {missing} never reached "
                "the store (a lost upload, not a code failure)")
    if rule is rules.WORKER_OOM_KILLED:
        sigkill = ctx.worker.exit is not None and ctx.worker.exit.signal == signal.SIGKILL
        killed = "the worker" if sigkill else "a process of the worker"
        return (f"host RAM exhausted: the kernel's OOM killer ended {killed}; not a GPU OOM "
                f"(worker {exited} without {missing}; the container's memory cgroup counted "
                "an OOM kill while it ran)")
    if match is None:
        return f"worker {exited} without completion artifacts ({missing} missing)"
    sig = match.signature
    if sig.id in ("disk-full", "shm-exhausted"):
        return _space_reason(ctx, rule, match, exited, missing)
    if rule is rules.WORKER_HOST_FAULT:
        return (f"host fault, retry on a fresh host: {sig.meaning} ({sig.id}); worker "
                f"{exited} without {missing}; its console: {match.line}")
    return (f"worker {exited} without completion artifacts ({missing} missing); its "
            f"console shows the job's own fault, which fails on any host: {sig.meaning} "
            f"({sig.id}): {match.line}")


def _space_reason(
    ctx: Context, rule: rules.Rule, match: policy.ConsoleMatch, exited: str, missing: str
) -> str:
    """A full disk or /dev/shm, with the filesystem's own figures."""
    if match.signature.id == "shm-exhausted":
        shm = ctx.evidence.get("shm", {})
        size = f"{shm['total_mib']} MiB" if "total_mib" in shm else "of unknown size"
        return (f"worker {exited} without {missing}: shared memory ran out (/dev/shm is "
                f"{size}); that is the container's configuration (--shm-size, --ipc=host) or "
                f"the job's own use (fewer DataLoader workers), the same on any host: "
                f"{match.line}")
    before = ctx.evidence.get("disk", {}).get("before_setup", [])
    if rule.retriable:
        was = [fs for fs in before if fs.get("short")]
        names = ", ".join(f"{fs['mount'] or fs['path']} had {fs['free_mib']} MiB free of "
                          f"{fs['total_mib']} MiB" for fs in was)
        return (f"host fault, retry on a fresh host: the disk was full before the attempt "
                f"wrote anything ({names} before setup); worker {exited} without {missing}; "
                f"its console: {match.line}")
    room = ", ".join(f"{fs['mount'] or fs['path']} {fs['free_mib']} MiB free" for fs in before)
    return (f"worker {exited} without {missing}: the job filled a disk ({room or 'no figures'} "
            f"before setup), which it would on any host of the kind: {match.line}")


def _host_failed(ctx: Context, p: Payload, missing: str) -> RetriableError:
    """The host watch stopped the worker: a GPU out of reach or gone is ``host-gpu-lost``,
    new uncorrectable ECC errors alone ``host-gpu-unhealthy``."""
    change = ctx.worker.gpu_change
    kinds = change.kinds() if change is not None else set()
    rule = rules.HOST_GPU_LOST if kinds & LOST_KINDS or not kinds else rules.HOST_GPU_UNHEALTHY
    kept = ctx.worker.stacks.file if ctx.worker.stacks is not None else None
    return RetriableError(
        f"the host's GPUs failed under the worker, retry on a fresh host: "
        f"{change.text if change is not None else 'the GPUs changed'}; the worker was "
        f"stopped without {missing}"
        + (f"; its stacks, taken first, are in {kept}" if kept else ""),
        rule=rule, stands_after_signal=True,
    )


def _gpus_since_start(ctx: Context) -> dict[str, bool]:
    """After a worker ended without its completion artifacts: the GPUs asked again, and
    compared with what they said before the worker started: a change they report (a GPU
    gone from a listing that answered, one out of reach, new uncorrectable ECC errors) is
    ``gpus_changed``; ``gpus_fine`` when every GPU answered the same. No answer is no
    change. Within ``FLASH_GPU_QUERY_S``, and never more than half of what verification
    has left; no snapshot before the worker, no comparison."""
    start = ctx.host_start
    if not watchable(start) or start is None:
        return {}
    left = ctx.begin_end().verify_budget().remaining()
    now = gpus.snapshot(ctx.environ, timeout_s=max(0.0, min(ctx.tuning.gpu_query_s, left / 2)))
    if not (verdict := gpus.changed(start, now)):
        fine = now.problem is None and now.listed and len(now.gpus) >= len(start.gpus)
        return {"gpus_fine": fine}
    ctx.worker.gpu_change = GpuChange("after the worker ended", verdict.evidence(),
                                      verdict.describe())
    return {"gpus_changed": True}


def _space_evidence(ctx: Context, signature: str) -> None:
    """The filesystems beside a console that says a disk or /dev/shm is full."""
    if signature == "disk-full":
        floor = storage.floor(ctx.merged_env())
        before = list(ctx.storage_start.values())
        ctx.evidence["disk"] = {
            "before_setup": [{**_space(fs), "short": storage.came_short(fs, floor)}
                             for fs in before],
            "now": [_space(now) for now in (storage.usage(Path(fs.path)) for fs in before)
                    if now is not None],
        }
    elif signature == "shm-exhausted":
        shm = storage.usage(Path("/dev/shm"))  # its size is the evidence
        if shm is not None:
            ctx.evidence["shm"] = _space(shm)


def _space(fs: storage.Usage) -> dict[str, object]:
    return {"path": fs.path, "mount": fs.mount, "total_mib": fs.size_bytes // MIB,
            "free_mib": fs.free_bytes // MIB, "free_inodes": fs.free_inodes}


def _stall_reason(ctx: Context, p: Payload, rule: rules.Rule, missing: str) -> str:
    stall = ctx.worker.stall
    where = (stall.place if stall is not None else None) or "a place the stacks do not show"
    text = (f"worker made no progress for {stall.silent_s if stall else 0:g}s (FLASH_STALL_S; "
            f"no console output, no touch of FLASH_PROGRESS_FILE) and was stopped without "
            f"{missing}; it was in {where}")
    if stall is not None and stall.last_line:
        text += f"; its last line: {stall.last_line}"
    kept = ctx.worker.stacks.file if ctx.worker.stacks is not None else None
    if kept:
        text += f"; the stacks of its processes are in {kept}"
    if rule is rules.WORKER_STALLED_AGAIN:
        text += (f"; attempt {p.dest.attempt - 1} stalled on the same line on another host: "
                 "the job hangs wherever it runs")
    return text


def _across_attempts(
    ctx: Context, p: Payload, rule: rules.Rule, match: policy.ConsoleMatch | None,
    facts: policy.WorkerFacts,
) -> rules.Rule:
    """This attempt's rule with the previous attempt as evidence (CONTRACT section 9), and
    the marker's ``fault``. The previous marker is read only when it could change the
    verdict: a retriable fault only the console or the worker witnessed."""
    stall = ctx.worker.stall
    place = stall.place if stall is not None and rule is rules.WORKER_STALLED else None
    changed = rule is rules.WORKER_HOST_FAULT and match is None and facts.gpus_changed
    fault = policy.fault_of(rule, match, gpus_changed=changed, place=place)
    if rule.retriable and fault.confirmed_by in ("console", "worker") and (
            rule is not rules.WORKER_HEARTBEAT_RETRIABLE):
        host = ctx.host_id()
        attempt, before = _previous_attempt(ctx, p, host)
        decided, _ = policy.across_attempts(rule, fault, host, p.run_id, before)
        if decided is not rule and before is not None:
            ctx.evidence["previous_attempt"] = {
                "attempt": attempt, "host": before.host_id, "fingerprint": fault.fingerprint}
            if place is not None and stall is not None:
                stall.previous = {"attempt": attempt, "where": place}
            rule = decided
            fault = fault._replace(rule=rule.id)
    ctx.judged_fault = fault
    return rule


def _previous_attempt(ctx: Context, p: Payload, host: str) -> tuple[int, policy.Previous | None]:
    """The previous attempt (CONTRACT section 9) and its marker as evidence, or None when
    there is none, or it is missing, unreadable or not of this kind. An engine that retries
    the payload itself (a Kubernetes Job) runs this attempt again on another host: a marker
    of this very attempt already in the store, written by another host, is the previous
    one; else it is ``<arm>_attempt<N-1>.json``. Each is read once, within verification's
    budget."""
    again = _marker_of(ctx, p, p.dest.attempt)
    if again is not None and policy.same_host(again.host_id, host) is False:
        return p.dest.attempt, again
    if p.dest.attempt == 0:
        return 0, None
    return p.dest.attempt - 1, _marker_of(ctx, p, p.dest.attempt - 1)


def _marker_of(ctx: Context, p: Payload, attempt: int) -> policy.Previous | None:
    name = marker.name(p.dest.arm, attempt)
    target = ctx.scratch / "previous-attempt"
    try:
        local = ctx.verify_store.download_file(p.dest.path(name), target)
        before = json_object(local.read_bytes(), limit=marker.MARKER_MAX_BYTES)
    except (StoreNotFound, StoreUnavailable, DeadlineExceeded, Interrupted, OSError,
            JsonProblem):
        # A signal meanwhile only cuts the evidence short: the worker had already ended on
        # its own, and its verdict stands (the flag stays set for Mark).
        return None
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return policy.previous_of(before)


def _console_tail(ctx: Context) -> str:
    """The worker console's redacted tail (what the store gets), or "" if unreadable."""
    try:
        return ctx.redactor.tail_of(console_path(ctx), TAIL_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


def _look(ctx: Context, p: Payload) -> tuple[dict[str, bool], bool]:
    """Which completion artifacts the store has; without both, the heartbeat's verdict.
    One listing of the run's folder answers both (and whether there is a heartbeat)."""
    listed = ctx.verify_store.list_folder(p.dest.hf_prefix)
    present = {name: name in listed for name in COMPLETION_ARTIFACTS}
    if all(present.values()) or HEARTBEAT not in listed:
        return present, False
    target = ctx.scratch / "heartbeat"
    try:  # the worker's own heartbeat for this attempt, typed strictly
        local = ctx.verify_store.download_file(p.dest.path(HEARTBEAT), target)
        return present, heartbeat_says_retriable(local, p.dest.attempt)
    except (StoreNotFound, OSError, ValueError):
        return present, False
    finally:
        shutil.rmtree(target, ignore_errors=True)


def _exit_text(ctx: Context) -> str:
    result = ctx.worker.exit
    if result is None:
        return "ended"
    if result.signal:
        return f"was killed by signal {result.signal}"
    return f"exited {result.returncode}"
