"""What the runner reads from the worker's own files, typed as strictly as the payload.

The worker writes ``heartbeat.json`` (CONTRACT section 4): ``{"stage", "ts", "attempt",
"retriable", ...}``. Its verdict counts only when every field the runner reads has its
type: ``attempt`` a JSON integer (``true`` is not attempt 1, ``1.0`` is not either),
``retriable`` a JSON boolean, ``ts`` a finite number and ``stage`` text when present. A
heartbeat that is larger than :data:`MAX_HEARTBEAT_BYTES`, not UTF-8 JSON, or not typed so
says nothing (and the log says why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from fsm.files import JsonProblem, finite_number, json_object

__all__ = ["MAX_HEARTBEAT_BYTES", "heartbeat_says_retriable"]

#: A heartbeat is a few fields: anything larger is not one.
MAX_HEARTBEAT_BYTES = 1 << 20
log = structlog.get_logger("fsm.worker_files")


def _problem(beat: dict[str, Any], attempt: int) -> str | None:
    """Why ``beat`` (a JSON object, :func:`fsm.files.json_object`'s) is not a well-typed
    heartbeat of ``attempt``, or None."""
    number = beat.get("attempt")
    if not isinstance(number, int) or isinstance(number, bool):
        return f"'attempt' is not an integer (got {type(number).__name__})"
    if number != attempt:
        return f"'attempt' is {number}, not this attempt ({attempt})"
    if not isinstance(beat.get("retriable", False), bool):
        return "'retriable' is not true/false"
    ts = beat.get("ts")
    if ts is not None and finite_number(ts) is None:
        return "'ts' is not a finite number"
    if not isinstance(beat.get("stage", ""), str):
        return "'stage' is not text"
    return None


def heartbeat_says_retriable(path: Path, attempt: int) -> bool:
    """Whether the heartbeat file at ``path`` is this attempt's and says ``retriable: true``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HEARTBEAT_BYTES + 1)
    except OSError:
        return False
    try:
        beat = json_object(data, limit=MAX_HEARTBEAT_BYTES)
        problem = _problem(beat, attempt)
    except JsonProblem as exc:
        problem = str(exc)
    if problem is not None:
        log.warning("heartbeat.ignored", reason=problem)
        return False
    return beat.get("retriable") is True
