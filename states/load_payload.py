"""LoadPayload: read and validate the payload, take the attempt's lock, fix the deadline,
open the store, and arm the GPUs' verdict (CONTRACT section 8): ``nvidia-smi`` was started
at the runner's first step, and setup goes on while it answers (``Context.watch_host``). A
short host (fewer GPUs than the payload's ``expect_gpus``), a sick GPU (uncorrectable ECC
errors, pages or rows pending retirement or remapping, a row-remapping failure, a GPU
nvidia-smi reports it cannot reach), a busy one (memory held or a compute process the
attempt did not start), or ``--query-gpu`` unanswered at ``FLASH_GPU_QUERY_S`` ends the
attempt the moment the answer says so, retriable, in whichever state is running; Train
starts no worker before the verdict (``Context.settle_host``).

Nothing is written for the attempt before its lock is held: a payload whose destination
is unusable gets no marker at all, and a runner that cannot get the lock (another live
runner owns the attempt) leaves without touching anything. Also where a restarted
container finds that its attempt already ended: a persisted result of exactly this
attempt of this run is replayed through Mark instead of training again.

The budget belongs to the attempt, not to the process: the attempt's first start is
persisted next to the payload (``fsm.attempt.start``), and a restarted runner of the same
attempt continues that budget (the worker gets the same ``FLASH_RUN_DEADLINE_AT``), or
ends the attempt at once with rule ``deadline`` when it is spent.

Runs even after a signal (the driver lets it): a signal that came during start-up must
still end in a retriable marker once the destination is known.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog

from fsm import payload, table
from fsm.attempt import result
from fsm.attempt import start as attempt_start
from fsm.attempt.lock import AttemptLock
from fsm.clock import Deadline
from fsm.context import Context, Tuning
from fsm.errors import AttemptBusy, DeadlineExceeded, Interrupted, PayloadError
from fsm.host import probe, storage
from fsm.host.probe import HostProbe
from fsm.output import log as log_config

log = structlog.get_logger("states.load_payload")
LOCK_WAIT_S = 30.0
REPLAY_BOUND_S = 30.0


def load_payload(ctx: Context) -> str:
    # The GPUs are asked first, in the background: their answer is due before any setup.
    ctx.host = HostProbe.for_attempt(ctx.environ)
    with ctx.interrupts_handled():
        raw = payload.read_raw(ctx.settings.payload_path)
        if isinstance(env := raw.get("env"), dict):
            ctx.raw_env = {k: v for k, v in env.items() if isinstance(v, str)}
            _learn_secrets(ctx)  # before anything can fail with one in its text
        if isinstance(raw.get("run_id"), str):
            ctx.evidence["run_id"] = ctx.redactor.keep_first(raw["run_id"], 200)
        retries = payload.engine_retries(ctx.environ)  # AWS Batch's own retries
        dest = payload.require_destination(raw, retries)  # unusable: no marker anywhere
        try:
            parsed: payload.Payload | None = payload.parse(raw, retries)
            problem: PayloadError | None = None
        except PayloadError as exc:
            parsed, problem = None, exc
        if parsed is not None:
            # This process's budget bounds the wait for the lock; once the lock is held,
            # the attempt's own start fixes the deadline (_own_budget).
            ctx.deadline = Deadline.for_attempt(_deadline_at(parsed, ctx.started_at))
        _take_lock(ctx, dest)
        ctx.dest = dest  # from here on this process owns the attempt and may mark it
        log_config.bind(run_id=ctx.evidence.get("run_id"), attempt=dest.attempt)
        if problem is not None:
            raise problem
        assert parsed is not None
        ctx.tuning = Tuning.from_env({**ctx.environ, **parsed.env})
        ident = result.identity(dest, run_id=parsed.run_id, mode=parsed.mode)
        recorded = result.load_persisted(result.result_path(ctx.settings.payload_path, dest), ident)
        spent = _own_budget(ctx, parsed, dest, ident) if recorded is None else None
        if recorded is not None:
            # A replay only re-publishes; it needs a short bound, not the (maybe past) budget.
            ctx.deadline = Deadline.after(REPLAY_BOUND_S)
        # An unusable store setting (FLASH_STORE in the payload's env) is the payload's
        # fault: it raises PayloadError before the payload counts as loaded.
        ctx.store = ctx.setup_store()
        ctx.payload = parsed
        ctx.scratch.mkdir(parents=True, exist_ok=True)
        if recorded is not None:
            ctx.replayed = recorded
            return table.RESULT_REPLAYED
        if spent is not None:
            raise DeadlineExceeded(spent)
        if ctx.interrupt.is_set():
            raise Interrupted(ctx.interrupt.signum or 15)
        ctx.watch_host(parsed.expect_gpus)  # from here a fault the GPUs report ends setup
        # The cache's filesystem too (the runner measured its own dirs at its start): a
        # full disk is judged against the room it had before setup (fsm.host.storage).
        ctx.storage_start = {**storage.snapshot([_cache_dir(ctx, parsed)]), **ctx.storage_start}
    if parsed.mode == "preload":
        return table.PRELOAD_REQUESTED
    if parsed.extra_pip:  # the code and a spilled spec download under the install
        ctx.start_ahead(table.LOAD_PAYLOAD)
    return table.TRAIN_REQUESTED


def _own_budget(
    ctx: Context, p: payload.Payload, dest: payload.Destination, ident: dict[str, Any]
) -> str | None:
    """Fix the attempt's deadline from the attempt's first start (persisted next to the
    payload by the runner that started it, else this runner's, persisted now), and say why
    the attempt must end at once when a restart finds its budget spent."""
    boot = probe.boot_id()
    path = result.start_path(ctx.settings.payload_path, dest)
    start, continued = attempt_start.begin(path, ident, ctx.started_at, boot)
    at = _deadline_at(p, start.started_at)
    deadline = start.deadline(at, boot)
    ctx.started_at = start.started_at  # the exit reserve is derived from the whole budget
    ctx.deadline = deadline
    if not continued:
        return None
    spent_s, left_s = start.spent_s(boot), deadline.remaining()
    log.info("attempt.continued", started_at=round(start.started_at, 3),
             spent_s=round(spent_s, 3), left_s=round(max(0.0, left_s), 3),
             deadline_at=round(at, 3), same_boot=start.same_boot(boot))
    first = (f"the deadline fixed at the attempt's first start "
             f"({_utc(start.started_at)}, {at - start.started_at:.0f}s budget)")
    if deadline.expired():
        # Only the marker is left to do: a short bound of its own (as a replay has), not a
        # deadline that has passed (the watchdog would fire at it at once).
        ctx.deadline = Deadline.after(REPLAY_BOUND_S)
        return (f"run wall deadline exceeded: {first} passed before this restart "
                f"({spent_s:.1f}s after that start)")
    if ctx.work_deadline.expired():
        return (f"run wall deadline exceeded: {first} left only the exit reserve "
                f"({left_s:.1f}s) when this restart came ({spent_s:.1f}s after that start)")
    return None


def _deadline_at(p: payload.Payload, started_at: float) -> float:
    """The attempt's deadline (epoch): the payload's own, else its budget from ``started_at``."""
    return p.deadline_at if p.deadline_at is not None else started_at + p.max_wall_s


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _take_lock(ctx: Context, dest: payload.Destination) -> None:
    """Hold the attempt's lock or leave: after a signal only a free lock is taken."""
    lock = AttemptLock(result.lock_path(ctx.settings.payload_path, dest))
    wait = 0.0 if ctx.interrupt.is_set() else LOCK_WAIT_S
    try:
        got = lock.acquire(wait, ctx.budget)
    except OSError:  # no lock can exist here, for any runner: the marker says why (storage)
        ctx.dest = dest
        raise
    if got == "held":
        ctx.lock = lock  # held until the process ends (released by the runner)
        return
    holder = f"attempt {dest.attempt} ({dest.marker_name}) is held by another live runner"
    why = {
        "busy": f"{holder} for over {LOCK_WAIT_S:.0f}s",
        "interrupted": f"{holder}; a signal ended the wait",
        "deadline": f"{holder}; the attempt deadline passed while waiting",
    }[got]
    raise AttemptBusy(f"{why}; this runner wrote nothing", ended_by=got)


def _cache_dir(ctx: Context, p: payload.Payload) -> Path:
    """The Hugging Face cache the worker writes to."""
    env = {**ctx.environ, **p.env}
    cache = env.get("HF_HUB_CACHE") or env.get("HF_HOME")
    return Path(cache) if cache else Path(env.get("HOME") or Path.home()) / ".cache" / "huggingface"


def _learn_secrets(ctx: Context) -> None:
    """Mask the payload env's secret values from here on, even if the payload is invalid."""
    listed = ",".join((ctx.environ.get("FLASH_SECRET_ENV_KEYS", ""),
                       ctx.raw_env.get("FLASH_SECRET_ENV_KEYS", "")))
    keys = ctx.redactor.learn(ctx.raw_env, listed.split(","))
    log.info("secrets.keys", keys=sorted(keys))  # which keys: never their values
