"""VerifyRemote: the worker's exit code proves nothing; its artifacts in the store do.

Success iff ``DONE`` and ``metrics.json`` are confirmed in the store, whatever the exit
code (a library may crash at interpreter exit after both uploads). Otherwise the
evidence decides between the worker's own retriable heartbeat, a lost upload, and a
worker that failed.

Runs after a signal too, within a short bound (``Context.verify_deadline``): confirmed
completion outranks a late SIGTERM. Without it, a worker the signal stopped makes the
attempt ``interrupted``; a worker that had exited on its own before the signal is judged
by its own exit.
"""

from __future__ import annotations

import json
import shutil

from fsm import rules, table
from fsm.context import SIGNAL_VERIFY_S, Context
from fsm.errors import FatalError, Interrupted, RetriableError, StoreNotFound, StoreUnavailable
from fsm.payload import Payload

COMPLETION_ARTIFACTS = ("DONE", "metrics.json")


def verify_remote(ctx: Context) -> str:
    p = ctx.require_payload()
    # A signal does not cut the look at the store short (its answer outranks the signal);
    # it bounds it: SIGNAL_VERIFY_S after the signal the attempt is marked interrupted.
    with ctx.interrupts_handled():
        try:
            present, heartbeat_retriable = ctx.run_past_signal(
                lambda: _look(ctx, p), until_s=SIGNAL_VERIFY_S
            )
        except StoreUnavailable as exc:
            raise RetriableError(
                f"could not read the store to verify the worker's completion: {exc}",
                rule=rules.VERIFY_UNREADABLE,
            ) from exc
    if all(present.values()):
        ctx.evidence["rule"] = rules.SUCCESS.id
        return table.COMPLETION_CONFIRMED

    result = ctx.worker_result
    on_its_own = result is not None and result.reason == "exited"
    if ctx.interrupt.is_set() and not on_its_own:
        raise Interrupted(ctx.interrupt.signum or 15)
    missing = ", ".join(name for name, ok in present.items() if not ok)
    exited = _exit_text(ctx)
    pointers = f"see error_{p.phase}.txt and console_{p.phase}.txt in the store"
    if heartbeat_retriable:
        raise RetriableError(
            f"worker {exited} without {missing} in the store; its heartbeat for attempt "
            f"{p.dest.attempt} says retriable; {pointers}",
            rule=rules.WORKER_HEARTBEAT_RETRIABLE,
            stands_after_signal=on_its_own,
        )
    if (ctx.scratch / "metrics.json").is_file():
        raise RetriableError(
            f"worker {exited} and wrote metrics.json locally, but {missing} never reached the "
            f"store (a lost upload, not a code failure); {pointers}",
            rule=rules.WORKER_UPLOAD_LOST,
            stands_after_signal=on_its_own,
        )
    raise FatalError(
        f"worker {exited} without completion artifacts ({missing} missing); {pointers}",
        rule=rules.WORKER_FAILED,
        stands_after_signal=on_its_own,
    )


def _look(ctx: Context, p: Payload) -> tuple[dict[str, bool], bool]:
    """Which completion artifacts the store has; without both, the heartbeat's verdict."""
    store = ctx.exit_store()
    present = {name: store.exists(p.dest.path(name)) for name in COMPLETION_ARTIFACTS}
    return present, not all(present.values()) and _heartbeat_says_retriable(ctx, p)


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


def _exit_text(ctx: Context) -> str:
    result = ctx.worker_result
    if result is None:
        return "ended"
    if result.signal:
        return f"was killed by signal {result.signal}"
    return f"exited {result.returncode}"
