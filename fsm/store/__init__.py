"""The artifact store: the port (``fsm.store.base``) and how to open an adapter for a URL.

Adapters are imported lazily inside :func:`open_store`. The Hub adapter speaks through
``huggingface_hub``, in the agent process ``flash-bootstrap run`` forks at its first
instruction (``fsm.hub.spawn``, ``fsm.hub.agent``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from fsm.budget import Budget
from fsm.clock import Deadline
from fsm.errors import PayloadError
from fsm.interrupt import InterruptFlag
from fsm.store.base import PRELOAD_IGNORE_PATTERNS, Store, StoreStats

__all__ = ["PRELOAD_IGNORE_PATTERNS", "open_store", "retry_delays"]


def open_store(
    url: str | None,
    *,
    repo_id: str,
    token: str | None,
    deadline: Deadline,
    environ: Mapping[str, str],
    interrupt: InterruptFlag | None = None,
    stats: StoreStats | None = None,
    budget: Budget | None = None,
) -> Store:
    """The store for ``url`` (``--store`` / ``FLASH_STORE``).

    * ``file:///abs/dir``: the local directory store (the directory *is* the dataset repo);
    * None or "": the Hugging Face Hub, at ``HF_ENDPOINT`` when that is set;
    * ``http(s)://host``: a Hub API server at that endpoint.

    ``environ`` is the environment the store obeys: the runner's own merged with the
    payload's ``env`` (CONTRACT section 2). ``HF_ENDPOINT``, the ``FLASH_STORE_*`` tuning
    knobs and the hub's ``HF_HUB_*`` settings are read from it, never from ``os.environ``.
    ``interrupt``: a signal ends the Hub adapter's waits between tries.
    ``stats``: where the handle counts its commits and 429s (shared by an attempt's handles).
    ``budget``, when given, bounds every call instead of ``deadline`` and ``interrupt`` (the
    end of the attempt hands in one split into tries, which outlives a signal for a while).
    Anything unusable is a :class:`~fsm.errors.PayloadError` (the command line or the
    payload is unusable).
    """
    parts = urlsplit(url or "")
    if url and url.startswith("file:"):
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise PayloadError("--store or FLASH_STORE: a file store must be file:///absolute/dir")
        from fsm.store.local import LocalStore

        return LocalStore(Path(path), deadline=deadline, stats=stats, interrupt=interrupt,
                          budget=budget)
    if url and parts.scheme not in ("http", "https"):
        raise PayloadError(
            f"--store or FLASH_STORE: unsupported store URL scheme {parts.scheme or url[:16]!r}"
        )
    from fsm.store.hub import HubStore

    return HubStore(repo_id, token=token, deadline=deadline, environ=environ,
                    interrupt=interrupt, endpoint=url or environ.get("HF_ENDPOINT") or None,
                    stats=stats, budget=budget, **_hub_tuning(environ))


#: Environment knobs of the Hub adapter's time bounds and retries (all optional):
#: variable -> (HubStore argument, type, whether 0 is allowed). Values must be finite,
#: not negative, and an attempt count at least 1.
_HUB_KNOBS: dict[str, tuple[str, type[int] | type[float], bool]] = {
    "FLASH_STORE_CALL_TIMEOUT_S": ("call_timeout_s", float, False),
    "FLASH_STORE_TRANSFER_TIMEOUT_S": ("transfer_timeout_s", float, False),
    "FLASH_STORE_MAX_ATTEMPTS": ("max_attempts", int, False),
    "FLASH_STORE_RETRY_BASE_S": ("retry_base_s", float, True),
    "FLASH_STORE_RETRY_MAX_S": ("retry_max_s", float, True),
}


def _hub_tuning(environ: Mapping[str, str]) -> dict[str, Any]:
    tuning: dict[str, Any] = {}
    for var, (name, kind, zero_ok) in _HUB_KNOBS.items():
        value = environ.get(var)
        if value:
            try:
                number = kind(value)
            except ValueError:
                raise PayloadError(f"{var}={value!r} is not a number") from None
            if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
                raise PayloadError(f"{var}={value!r} is out of range")
            tuning[name] = number
    return tuning


def retry_delays(environ: Mapping[str, str]) -> tuple[float, float]:
    """The base and the longest wait between tries of a store call (``FLASH_STORE_RETRY_BASE_S``,
    ``FLASH_STORE_RETRY_MAX_S``; 1 and 30 s by default), the marker's tries included.
    Raises :class:`~fsm.errors.PayloadError` for an unusable value."""
    tuning = _hub_tuning(environ)
    return tuning.get("retry_base_s", 1.0), tuning.get("retry_max_s", 30.0)
