"""``huggingface_hub`` imported in the background from a runner's first instruction.

The Hub adapter speaks to the store through the library, whose import (its HTTP stack:
httpx2 on 2.x, requests on 0.x) takes 80 to 130 ms. ``flash-bootstrap run`` starts it in
a daemon thread before anything else (:func:`start`), so it overlaps reading the payload
and the host checks, and FetchCode finds the library loaded (a store call made before it
is done waits for the same import). The transfer switch is set in the environment first
(``fsm.store.hub.configure_transfer``'s rules), since the library freezes its settings
then; the payload's ``HF_HUB_*`` settings, read later, are set in the frozen constants.

Once logging is set up, :func:`report` logs ``hub.import_started`` (when the thread began,
``at``, epoch seconds) and ``hub.import_finished`` (when it ended, how long it took, and
the error's type if it failed), whichever thread gets there last.

Standard library only: this module is imported before anything heavy.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["given_environ", "report", "start", "wait"]

_lock = threading.Lock()
_done = threading.Event()
_thread: threading.Thread | None = None
_started_at: float | None = None
_ended_at: float | None = None
_error: str | None = None
_reporting = False
_given: dict[str, str] | None = None


def _local_store(argv: list[str], environ: os._Environ[str] | dict[str, str]) -> bool:
    """Whether the command line (or the environment) names a local directory store: then
    no Hub call is made, and the import would only take CPU from the attempt."""
    for i, arg in enumerate(argv):
        if arg == "--store" and i + 1 < len(argv):
            return argv[i + 1].startswith("file:")
        if arg.startswith("--store="):
            return arg.removeprefix("--store=").startswith("file:")
    return environ.get("FLASH_STORE", "").startswith("file:")


def start(argv: list[str] | None = None) -> bool:
    """Start the import (once); False when there is nothing to import or no Hub to call."""
    global _thread, _started_at, _given
    if _thread is not None:
        return True
    if _local_store(sys.argv[1:] if argv is None else argv, os.environ):
        return False
    _given = dict(os.environ)  # before the import's settings go in: the worker's is this
    _started_at = time.time()
    _thread = threading.Thread(target=_run, name="hub-import", daemon=True)
    _thread.start()
    return True


def given_environ() -> dict[str, str]:
    """The process environment as it was given, before the import set the hub's switches
    in it (they are the runner's, not the worker's)."""
    return dict(os.environ if _given is None else _given)


def wait(timeout_s: float) -> bool:
    """Whether the import (if started) has ended within ``timeout_s``."""
    return _thread is None or _done.wait(timeout_s)


def _run() -> None:
    global _ended_at, _error
    try:
        from fsm.store import hub

        hub.import_library()
    except BaseException as exc:  # the store's first call imports it again, and says why
        _error = type(exc).__name__
    finally:
        with _lock:
            _ended_at = time.time()
            _done.set()
            late = _reporting
        if late:
            _finished()


def report() -> None:
    """Log the import's start (and its end, once it has ended); call once logging is set."""
    global _reporting
    if _thread is None or _started_at is None:
        return
    import structlog

    structlog.get_logger("fsm.hub_import").info("hub.import_started", at=round(_started_at, 6))
    with _lock:
        _reporting = True
        ended = _ended_at is not None
    if ended:
        _finished()


def _finished() -> None:
    import structlog

    assert _started_at is not None and _ended_at is not None
    structlog.get_logger("fsm.hub_import").info(
        "hub.import_finished", at=round(_ended_at, 6),
        seconds=round(_ended_at - _started_at, 4), error=_error)
