"""VerifyRemote: the worker's exit code proves nothing; its artifacts in the store do.

Success iff ``DONE`` and ``metrics.json`` are confirmed in the store, whatever the exit
code (a library may crash at interpreter exit after both uploads). Otherwise the
evidence decides between the worker's own retriable heartbeat, a lost upload, and a
worker that failed.
"""

from __future__ import annotations

import json
import shutil

from fsm import policy, table
from fsm.console import upload_tail
from fsm.context import Context
from fsm.errors import FatalError, RetriableError, StoreNotFound, StoreUnavailable
from fsm.payload import Payload

COMPLETION_ARTIFACTS = ("DONE", "metrics.json")


def verify_remote(ctx: Context) -> str:
    p = ctx.require_payload()
    store = ctx.exit_store()
    try:
        present = {name: store.exists(p.dest.path(name)) for name in COMPLETION_ARTIFACTS}
        if all(present.values()):
            ctx.evidence["rule"] = policy.SUCCESS_RULE
            return table.COMPLETION_CONFIRMED
        heartbeat_retriable = _heartbeat_says_retriable(ctx, p)
    except StoreUnavailable as exc:
        upload_tail(ctx)
        raise RetriableError(
            f"could not read the store to verify the worker's completion: {exc}",
            rule="verify-unreadable",
        ) from exc

    missing = ", ".join(name for name, ok in present.items() if not ok)
    if not (ctx.tuning.upload_console or _worker_failed(ctx)):
        upload_tail(ctx)  # a failed attempt always leaves its console tail
    exited = _exit_text(ctx)
    pointers = f"see error_{p.phase}.txt and console_{p.phase}.txt in the store"
    if heartbeat_retriable:
        raise RetriableError(
            f"worker {exited} without {missing} in the store; its heartbeat for attempt "
            f"{p.dest.attempt} says retriable; {pointers}",
            rule="worker-heartbeat-retriable",
        )
    if (ctx.scratch / "metrics.json").is_file():
        raise RetriableError(
            f"worker {exited} and wrote metrics.json locally, but {missing} never reached the "
            f"store (a lost upload, not a code failure); {pointers}",
            rule="worker-upload-lost",
        )
    raise FatalError(
        f"worker {exited} without completion artifacts ({missing} missing); {pointers}",
        rule="worker-failed",
    )


def _heartbeat_says_retriable(ctx: Context, p: Payload) -> bool:
    """Whether the worker's own heartbeat for this attempt judged its failure retriable."""
    target = ctx.scratch / "heartbeat"
    try:
        local = ctx.exit_store().download_file(p.dest.path("heartbeat.json"), target)
        beat = json.loads(local.read_text(encoding="utf-8"))
    except (StoreNotFound, OSError, ValueError):
        return False
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return (
        isinstance(beat, dict)
        and beat.get("retriable") is True
        and beat.get("attempt") == p.dest.attempt
    )


def _worker_failed(ctx: Context) -> bool:
    """True when Train already uploaded the tail because the worker failed."""
    result = ctx.worker_result
    return result is not None and result.returncode != 0


def _exit_text(ctx: Context) -> str:
    result = ctx.worker_result
    if result is None:
        return "ended"
    if result.signal:
        return f"was killed by signal {result.signal}"
    return f"exited {result.returncode}"
