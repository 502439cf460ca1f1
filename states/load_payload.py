"""LoadPayload: read and validate the payload, open the store, fix the deadline.

Also where a restarted container finds that its attempt already ended: the persisted
result is replayed through Mark instead of training again.
"""

from __future__ import annotations

from fsm import marker, payload, table
from fsm.clock import Deadline
from fsm.context import Context, Tuning
from fsm.errors import AttemptBusy
from fsm.log import REDACTOR
from fsm.redact import secret_keys

LOCK_WAIT_S = 30.0
REPLAY_BOUND_S = 60.0


def load_payload(ctx: Context) -> str:
    raw = payload.read_raw(ctx.settings.payload_path)
    _learn_secrets(ctx, raw.get("env"))  # before anything can fail with one in its text
    if isinstance(raw.get("run_id"), str):
        ctx.evidence["run_id"] = raw["run_id"][:200]
    ctx.dest = payload.destination(raw)
    if ctx.dest is not None:
        # Known as early as possible: even an invalid payload gets its fatal marker.
        ctx.store = ctx.open_store(ctx.dest, ctx.deadline)

    parsed = payload.parse(raw)
    ctx.payload = parsed
    ctx.dest = parsed.dest
    ctx.tuning = Tuning.from_env(ctx.merged_env())
    ctx.deadline = (
        Deadline.at_epoch(parsed.deadline_at)
        if parsed.deadline_at is not None
        else Deadline.at_epoch(ctx.started_at + parsed.max_wall_s)
    )
    ctx.store = ctx.open_store(parsed.dest, ctx.work_deadline)
    ctx.scratch.mkdir(parents=True, exist_ok=True)

    lock = marker.acquire_lock(ctx.settings.payload_path, parsed.dest, LOCK_WAIT_S)
    if lock is None:
        raise AttemptBusy(
            f"attempt {parsed.dest.attempt} is held by another live runner "
            f"(lock {marker.lock_path(ctx.settings.payload_path, parsed.dest)})"
        )
    ctx.lock = lock  # held until the attempt has ended (released by the runner)

    recorded = marker.read_result(marker.result_path(ctx.settings.payload_path, parsed.dest))
    if recorded is not None:
        ctx.replayed = recorded
        # A replay only re-publishes; it needs a short bound, not the (maybe past) budget.
        ctx.deadline = Deadline.after(REPLAY_BOUND_S)
        return table.RESULT_REPLAYED
    return table.PRELOAD_REQUESTED if parsed.mode == "preload" else table.TRAIN_REQUESTED


def _learn_secrets(ctx: Context, env: object) -> None:
    """Mask the payload env's secret values from here on, even if the payload is invalid."""
    if not isinstance(env, dict):
        return
    text_env = {str(k): v for k, v in env.items() if isinstance(v, str)}
    listed = ",".join(
        (ctx.environ.get("FLASH_SECRET_ENV_KEYS", ""), text_env.get("FLASH_SECRET_ENV_KEYS", ""))
    )
    secrets = [text_env[k] for k in secret_keys(text_env, listed.split(","))]
    ctx.redactor.add(secrets)
    REDACTOR.add(secrets)
