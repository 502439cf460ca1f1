"""What the Hub adapter needs of ``huggingface_hub`` itself: loading it, its settings, and
reading its failures. Standard library only at import: the agent process
(``fsm.hub.agent``) imports this before the library, and the runner's side reads the
classifications it sends.

* The fast-transfer switch (:func:`switch_transfer`), set in a process's environment
  before the library's import: the library freezes its settings then.
* :func:`load_library`: the import, once the switch is set; ``HF_HUB_OFFLINE`` is never
  obeyed by the runner's calls (it is the worker's setting).
* :func:`apply_settings`: the payload's ``HF_HUB_*``/``HF_XET_*`` settings, read after the
  import, set in the frozen constants where the library keeps them under their own names.
* :func:`classify`: how a call failed, from the exception and its cause chain (the
  transport types differ between the hub lines): retriable (connection errors, timeouts,
  408/409/425/429, 5xx, with the wait the answer asks for), auth (401/403), not found
  (404), rejected (any other 4xx), or unknown.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal

from fsm import deferred
from fsm.errors import causes
from fsm.prefetch import Background
from fsm.rules import AUTH_STATUSES, TRANSIENT_STATUSES

__all__ = ["TRANSPORT_SETTINGS", "Accelerator", "Failure", "FailureKind", "RemoteFailure",
           "apply_settings", "classify", "hub_major", "load_library", "switch_transfer"]

#: How a process reaches the network, read by the HTTP clients themselves (requests on the
#: 0.x line, httpx on 1.x/2.x, hf_xet's own client) from the environment: proxies and the
#: certificate authorities a private mirror's certificate chains to. The payload's env
#: sets them for the worker, so for the runner's own calls too (CONTRACT section 2).
TRANSPORT_SETTINGS: tuple[str, ...] = (
    "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
    "NO_PROXY", "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
)

Accelerator = Literal["hf_transfer", "hf_xet", "none"]


@functools.cache
def hub_major() -> int | None:
    """The installed huggingface_hub's major version, read without importing it (once: a
    metadata lookup scans every installed distribution)."""
    import importlib.metadata  # the agent's (the runner's side never asks)

    try:
        return int(importlib.metadata.version("huggingface_hub").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def switch_transfer(environ: MutableMapping[str, str], *, accelerate: bool = True,
                     ) -> tuple[Accelerator, bool]:
    """Switch the fast-transfer accelerator on in ``environ`` (``accelerate=False``: off);
    return its name, and whether the hub was imported already (then the setting cannot
    count; in this process's own environment it is set in the frozen constants too).

    * 0.x with ``hf_transfer`` installed: ``HF_HUB_ENABLE_HF_TRANSFER=1`` → ``"hf_transfer"``
      (parallel ranged GETs for files over 50 MiB);
    * 1.x/2.x with ``hf_xet`` (and Xet not disabled): ``HF_XET_HIGH_PERFORMANCE=1`` →
      ``"hf_xet"`` (1.x/2.x ignore ``HF_HUB_ENABLE_HF_TRANSFER``);
    * otherwise: ``"none"``.

    Telemetry is always disabled (``HF_HUB_DISABLE_TELEMETRY=1``). The hub line is read
    from the installed distribution's metadata, without importing it."""
    environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    major = hub_major()
    constants = sys.modules.get("huggingface_hub.constants")
    if major is None:
        return "none", constants is not None
    candidate: Accelerator
    if major == 0:
        switch, candidate, allowed = "HF_HUB_ENABLE_HF_TRANSFER", "hf_transfer", True
    else:
        environ.pop("HF_HUB_ENABLE_HF_TRANSFER", None)  # only earns a deprecation warning
        disabled = environ.get("HF_HUB_DISABLE_XET", "").strip().lower()
        switch, candidate = "HF_XET_HIGH_PERFORMANCE", "hf_xet"
        allowed = disabled not in ("1", "true", "yes", "on")
    on = accelerate and allowed and importlib.util.find_spec(candidate) is not None
    environ[switch] = "1" if on else "0"
    if environ is os.environ and hasattr(constants, switch):
        # Too late for the environment to count: set the frozen setting too (it is read
        # from the constants module at call time).
        setattr(constants, switch, on)
    return (candidate if on else "none"), constants is not None


#: Imported by the library at its import and used by none of the adapter's calls
#: (``idna``: host names beyond ASCII; ``truststore``: the certificate stores of Windows
#: and macOS; ``yaml``: model cards, whose ``dump`` the library binds at its import and
#: calls only to write one): deferred to their first use (``fsm.deferred``).
UNUSED_BY_THE_CALLS = ("idna", "truststore", "yaml")
DEFERRED_CALLS = {"yaml": ("dump",)}
#: What the library's HTTP stack takes when it is installed and does without otherwise;
#: the library is imported as if each were absent:
#:
#: * ``anyio``: httpcore's async transport (the adapter's calls are synchronous);
#: * ``brotli``, ``brotlicffi``, ``backports.zstd``: httpx's decoders of ``br`` and
#:   ``zstd`` bodies (never asked for then: its ``Accept-Encoding`` names only what it
#:   can decode);
#: * ``chardet``, ``charset_normalizer``: requests' guess at a text body's encoding when
#:   the answer names none (utf-8 without one: the Hub's JSON is utf-8, files are bytes).
OPTIONAL_FOR_THE_CALLS = ("anyio", "brotli", "brotlicffi", "backports.zstd", "chardet",
                          "charset_normalizer")
#: requests' warning at its import when it finds no encoding guesser (see above).
_NO_GUESSER_WARNING = "Unable to find acceptable character detection dependency"


def load_library() -> None:
    """Import what the adapter calls of ``huggingface_hub`` (in the agent process,
    ``fsm.hub.agent``, whose environment holds the transfer switch by then), less what
    those calls never use (:data:`UNUSED_BY_THE_CALLS`, :data:`OPTIONAL_FOR_THE_CALLS`).
    The runner's own calls never obey ``HF_HUB_OFFLINE``: it is the worker's setting."""
    import warnings

    deferred.defer(UNUSED_BY_THE_CALLS, calls=DEFERRED_CALLS)
    warnings.filterwarnings("ignore", message=_NO_GUESSER_WARNING)
    with deferred.without(OPTIONAL_FOR_THE_CALLS):
        from huggingface_hub import constants
        from huggingface_hub.utils import (  # type: ignore[attr-defined]
            disable_progress_bars,
            get_session,
        )

        # The frozen offline switch off: the store is what the runner must reach.
        constants.HF_HUB_OFFLINE = False
        # The library's one shared HTTP client (1.x/2.x; 0.x keeps one per thread), made
        # beside the rest of the import: building it reads the system's certificate store
        # (OpenSSL parsing every CA, some 50 ms, with the GIL released), which then
        # overlaps importing ``hf_api``.
        session = Background(get_session, "hub-session") if (hub_major() or 0) >= 1 else None
        from huggingface_hub import HfApi, hf_hub_download

        del HfApi, hf_hub_download  # imported for their modules (hf_api, file_download)
        disable_progress_bars()  # the agent's stderr reaches the runner's JSON lines
        if session is not None:
            session.done.wait()
            session.result()  # its failure is the import's, as if it had been made in line


def apply_settings(settings: Mapping[str, str]) -> list[str]:
    """``settings`` in this process (the agent's): into the environment when
    ``huggingface_hub`` is not imported yet; after it, a setting its constants module holds
    under its own name is set there, as the import would have. Returns the others (by
    name): the library read them at its import, and they cannot count now.
    ``HF_HUB_ENABLE_HF_TRANSFER`` counts on 0.x only (1.x/2.x only warn about it).

    ``TRANSPORT_SETTINGS`` always go into the environment: the HTTP clients read them when
    they are made, so the library's shared client is closed and made again at its next
    request (free when none was made yet, as before the first call; a call in flight
    meanwhile fails as a connection error and is retried)."""
    wanted = {key: value for key, value in settings.items() if os.environ.get(key) != value
              and not (key == "HF_HUB_ENABLE_HF_TRANSFER" and hub_major() != 0)}
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is None:
        os.environ.update(wanted)
        return []
    transport = {key: value for key, value in wanted.items() if key in TRANSPORT_SETTINGS}
    if transport:
        os.environ.update(transport)
        # The library's shared HTTP client closed, to be made again from the environment.
        close = (getattr(sys.modules.get("huggingface_hub"), "close_session", None)  # 1.x, 2.x
                 or getattr(sys.modules.get("huggingface_hub.utils"), "reset_sessions", None))
        if close is not None:
            close()
    late = []
    for key in wanted.keys() - transport.keys():
        typed = _typed(getattr(constants, key, _MISSING), wanted[key])
        if typed is _MISSING:
            late.append(key)
        else:
            setattr(constants, key, typed)
    return sorted(late)


_MISSING = object()


def probe(names: list[str]) -> dict[str, dict[str, object]]:
    """For each setting in ``names``: the library's constant of that name (when it has
    one; plain values only) and this process's environment's value."""
    constants = sys.modules.get("huggingface_hub.constants")
    found: dict[str, dict[str, object]] = {name: {"environ": os.environ.get(name)}
                                            for name in names}
    for name, entry in found.items():
        value = getattr(constants, name, _MISSING)
        if value is None or isinstance(value, str | int | float | bool):
            entry["constant"] = value
    return found


def _typed(current: object, value: str) -> object:
    """The text ``value`` typed as a constant's ``current`` value is; ``_MISSING`` when it
    does not fit that type (or there is no such constant)."""
    if isinstance(current, bool):
        return value.strip().upper() in ("1", "ON", "YES", "TRUE")
    if isinstance(current, int | float):
        with contextlib.suppress(ValueError):
            return type(current)(value)
        return _MISSING
    return value if current is None or isinstance(current, str) else _MISSING


FailureKind = Literal["retriable", "auth", "not_found", "rejected", "unknown"]

# Transport failures by top-level module and class name anywhere in the MRO (every class
# of hf_transfer's): the libraries may not be installed, so they are not imported to
# compare types.
_TRANSPORT_TYPES = {
    "requests": ("ConnectionError", "Timeout", "ChunkedEncodingError"),
    "urllib3": ("ProtocolError", "TimeoutError", "NewConnectionError"),
    "httpx2": ("TransportError",),
    "httpx": ("TransportError",),
    "httpcore": ("NetworkError", "TimeoutException", "RemoteProtocolError"),
    "socket": ("gaierror",),  # a name that does not resolve (the adapter's own reads)
    "ssl": ("SSLError",),
}


class RemoteFailure(Exception):
    """A call that failed in the agent process, as :func:`classify` read it there (the
    exception itself stays there: its text may hold a URL)."""

    def __init__(self, failure: Failure, type_name: str) -> None:
        super().__init__(f"{type_name} in huggingface_hub")
        self.failure = failure


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    reason: str  # secret-free: "HTTP 503", "ConnectError", "no answer within 5s"
    status: int | None = None
    retry_after: float | None = None
    hung: bool = False  # no answer within the try's bound
    error_code: str | None = None  # the answer's X-Error-Code (RepoNotFound, EntryNotFound)


_RATELIMIT = re.compile(r'"[^"]*"\s*;\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)')


def _retry_after(response: object) -> float | None:
    """The wait the answer asks for, if any: ``Retry-After`` (seconds or an HTTP date), else
    the reset of an exhausted ``RateLimit`` window (``"api";r=0;t=<seconds>``, the IETF
    draft the Hub follows; its 429 may carry no ``Retry-After`` at all)."""
    value = (_header(response, "Retry-After") or "").strip()
    if not value:
        found = _RATELIMIT.search(_header(response, "RateLimit") or "")
        return float(found.group(2)) if found is not None and int(found.group(1)) == 0 else None
    with contextlib.suppress(ValueError):  # else an HTTP date
        return max(0.0, float(value))
    import email.utils

    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _is_transport(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    # (Not imported here: a process that never imported http.client meets none of its
    # exceptions, and the runner's side would pay for ssl and email to look.)
    client = sys.modules.get("http.client")
    if client is not None and isinstance(exc, client.HTTPException):
        return True
    if isinstance(exc, RuntimeError) and "hf_transfer" in str(exc):
        return True  # 0.x wraps every hf_transfer failure in a RuntimeError
    for cls in type(exc).__mro__:
        root = cls.__module__.split(".")[0]
        if cls.__name__ in _TRANSPORT_TYPES.get(root, ()) or root == "hf_transfer":
            return True
    return False




def _header(response: object, name: str) -> str | None:
    headers = getattr(response, "headers", None)
    try:
        value = headers.get(name) if headers is not None else None
    except Exception:
        return None
    return value if isinstance(value, str) else None


def classify(exc: BaseException) -> Failure:
    """How a store call failed, from the exception and its cause chain (a call of the agent
    process was classified there)."""
    if isinstance(exc, RemoteFailure):
        return exc.failure
    chain = list(causes(exc))
    for current in chain:
        try:
            response = getattr(current, "response", None)
        except Exception:  # httpx raises when a request/response was never attached
            continue
        status = getattr(response, "status_code", None)
        if not isinstance(status, int) or isinstance(status, bool):
            continue
        kind: FailureKind = (
            "auth" if status in AUTH_STATUSES else "not_found" if status == 404
            else "retriable" if status in TRANSIENT_STATUSES else "rejected")
        wait = _retry_after(response) if kind == "retriable" else None
        return Failure(kind, f"HTTP {status}", status, wait,
                       error_code=_header(response, "X-Error-Code"))
    for current in chain:
        if _is_transport(current):
            return Failure("retriable", type(current).__name__)
    return Failure("unknown", type(exc).__name__)


