"""An attempt's result kept next to the payload, for restart safety.

The result is persisted (:func:`persist`) with the attempt's identity before it is
published, next to the payload (in production the bind-mounted ``/root/flash``, which
survives the container). A runner started again for exactly that attempt of that run
replays it instead of training again (:func:`load_persisted`); a record of anything else
is set aside, never replayed. The attempt's start (``fsm.attempt.start``) and its lock
(``fsm.attempt.lock``) live beside it (:func:`start_path`, :func:`lock_path`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from fsm.attempt import marker
from fsm.files import JsonProblem, json_object, write_atomic
from fsm.payload import Destination

__all__ = ["RESULT_VERSION", "Persisted", "identity", "load_persisted", "lock_path", "persist",
           "read_own", "result_path", "start_path"]

#: The persisted result's format; a file of any other version is set aside, never replayed.
RESULT_VERSION = 1
log = structlog.get_logger("fsm.marker")


def identity(dest: Destination, *, run_id: str | None, mode: str) -> dict[str, Any]:
    """What makes a persisted result this attempt's (CONTRACT section 4): replayed only when
    every one of these is equal."""
    return {"hf_repo": dest.hf_repo, "hf_prefix": dest.hf_prefix, "run_id": run_id, "mode": mode,
            "flash_arm": dest.arm, "attempt": dest.attempt}


def result_path(payload_path: Path, dest: Destination) -> Path:
    """Where the attempt's result is persisted: next to the payload."""
    return payload_path.parent / f".flash-{dest.arm}_attempt{dest.attempt}.result.json"


def start_path(payload_path: Path, dest: Destination) -> Path:
    """Where the attempt's first start is persisted (``fsm.attempt.start``): next to the
    payload, so that a restarted runner continues the attempt's budget."""
    return payload_path.parent / f".flash-{dest.arm}_attempt{dest.attempt}.start.json"


def lock_path(payload_path: Path, dest: Destination) -> Path:
    return payload_path.parent / f".flash-{dest.arm}_attempt{dest.attempt}.lock"


class Persisted(NamedTuple):
    """A finished attempt's result as persisted next to the payload: its marker and the
    end-of-attempt artifacts that go up in the same commit."""

    marker: dict[str, Any]
    artifacts: dict[str, str]
    #: Names under the prefix the same commit removes when present: the attempt's lease.
    remove: tuple[str, ...] = ()


def persist(path: Path, ident: dict[str, Any], record: Persisted) -> None:
    data = {"version": RESULT_VERSION, "identity": ident, **record._asdict()}  # remove: a list
    write_atomic(path, json.dumps(data), durable=True)


def load_persisted(path: Path, ident: dict[str, Any]) -> Persisted | None:
    """This attempt's persisted result, or None.

    A file that is there but not exactly this attempt's (another run's, another mode's, an
    older format, a malformed marker) is never replayed: it is moved aside, kept for
    forensics, and logged, and the attempt runs.
    """
    try:
        found = read_own(path, ident, version=RESULT_VERSION, what="result")
    except OSError as exc:
        log.warning("result.unreadable", path=str(path), error=exc.strerror)
        return None
    # this attempt's result, None (no file), or why the file there is set aside
    verdict = _persisted(found, ident) if isinstance(found, dict) else found
    if not isinstance(verdict, str):
        return verdict
    aside = path.with_name(f"{path.name}.set-aside-{time.time_ns()}")
    try:
        os.replace(path, aside)
    except OSError as exc:
        log.error("result.set_aside_failed", path=str(path), reason=verdict, error=exc.strerror)
        return None
    log.warning("result.set_aside", path=str(path), kept_as=str(aside), reason=verdict)
    return None


def read_own(path: Path, ident: dict[str, Any], *, version: int, what: str,
             ) -> dict[str, Any] | str | None:
    """The JSON object at ``path`` when it is the ``version`` format of this attempt's
    ``what`` (its identity ``ident``, as :func:`identity` makes it), else why not; None when
    there is no file. The persisted result and the start file (``fsm.attempt.start``) are
    read here. A file that cannot be read raises its ``OSError``."""
    try:
        raw = json_object(path.read_bytes())
    except FileNotFoundError:
        return None
    except JsonProblem as exc:
        return str(exc)
    recorded = raw.get("identity")
    if raw.get("version") != version:
        return f"not version {version}"
    if not isinstance(recorded, dict):
        return "no attempt identity"
    if recorded != ident:
        differ = sorted(k for k in set(ident) | set(recorded) if recorded.get(k) != ident.get(k))
        return f"another attempt's {what} (differs in {', '.join(differ)})"
    return raw


def _persisted(raw: dict[str, Any], ident: dict[str, Any]) -> Persisted | str:
    """This attempt's result as ``raw`` holds it, else why it cannot be replayed."""
    record, artifacts = raw.get("marker"), raw.get("artifacts", {})
    if (problem := marker.problem(record, ident["attempt"])) is not None:
        return f"malformed marker: {problem}"
    if not isinstance(artifacts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in artifacts.items()):
        return "malformed artifacts"
    remove = raw.get("remove", [])
    if not isinstance(remove, list) or not all(isinstance(name, str) for name in remove):
        return "malformed removals"
    assert isinstance(record, dict)
    return Persisted(marker=record, artifacts=artifacts, remove=tuple(remove))
