"""A local Hugging Face Hub API server that the real ``huggingface_hub`` client accepts.

Standard library only. It binds ``127.0.0.1`` on a free port and keeps every repo as a
plain directory under its root::

    root/datasets/<org>/<name>/<path in repo>
    root/models/<org>/<name>/<path in repo>

It implements what uploads, existence checks and downloads need, on both client lines
(``huggingface_hub`` 0.x and 1.x/2.x):

* ``HEAD``/``GET /{datasets/}<repo>/resolve/<rev>/<path>``: the file, with the headers the
  client requires (``X-Repo-Commit``, ``ETag``, ``Content-Length``); ranged GETs are
  answered ``206`` with ``Content-Range`` (what hf_transfer needs); a missing file or repo is
  ``404`` with ``X-Error-Code: EntryNotFound`` / ``RepoNotFound``;
* ``GET /api/<type>s/<repo>[/revision/<rev>]``: ``sha``, ``siblings`` and ``lastModified``
  (the time of the repo's last commit); with ``expand=<field>`` (repeated) only the named
  fields, plus ``id`` and ``_id``, as the Hub answers;
* ``GET /api/<type>s/<repo>/refs``: the one branch, ``main``, and its commit;
* ``GET /api/<type>s/<repo>/commits/<rev>``: the repo's commits newest first (``id``,
  ``title``, ``message``, ``authors``, ``date``), in pages of 50 linked by ``Link:
  <...?p=N>; rel="next"`` as the Hub's (the history is of dates and titles: every
  revision's content is the current one);
* ``GET /api/<type>s/<repo>/tree/<rev>[/<path>]``: the tree listing (``recursive=true``),
  in pages of 1,000 entries linked by ``Link: <...&cursor=N>; rel="next"`` as the Hub's
  (:meth:`LocalHubServer.set_tree_page` makes them smaller); with ``expand=true`` each
  entry carries its ``lastCommit`` (``id``, ``title``, ``date``), in pages of 50;
* ``POST /api/<type>s/<repo>/paths-info/<rev>``: the entries of the named ``paths`` that
  exist (the others left out), ``expand`` as for the tree;
* ``POST /api/<type>s/<repo>/preupload/<rev>``: every file is ``regular``, so neither LFS
  nor Xet machinery is needed;
* ``POST /api/<type>s/<repo>/commit/<rev>``: NDJSON commits with inline base64 content,
  deletions included. When the header line names a ``parentCommit`` (the client's
  ``create_commit(parent_commit=...)``), it is checked when the commit is applied, under
  the write lock and after any injected hang: a parent that is not the repo's current
  commit is answered ``412`` (``{"error": "A commit has happened since. Please refresh
  and try again."}``, like the Hub) and nothing is written. A deletion of a file that is
  not there is answered ``404`` with ``X-Error-Code: EntryNotFound``, and nothing is
  written; a folder left empty by a deletion goes (git keeps no empty folders).

Each commit is dated by the server's clock (``time.time()`` when it is applied; the Hub
sends dates with millisecond precision, truncated here): the server keeps, per repo and
path, the date, title and id of the last commit that wrote the file (``lastCommit`` in
expanded listings), and the date of the repo's last commit (its ``lastModified``).
:meth:`LocalHubServer.add_file` counts as a commit (``when=`` backdates it); a file put
in a repo's directory behind the server's back is dated by its modification time.

A server built with ``token=`` answers ``401`` to any request whose
``Authorization: Bearer`` header does not carry exactly that token. The token is never
echoed, logged or recorded.

Any revision name is served from the repo's current content: ``main`` and any 40-hex
commit id resolve to the current commit (the history is of dates and titles only).

Faults are injected per request, matched by method (``"*"`` for any) and a regular
expression searched in the request path (without the query string). They apply before
the token check, like a load balancer in front of the Hub would::

    with LocalHubServer(tmp_path, token="hf_test") as hub:
        hub.create_repo("org/data")
        hub.fail("POST", r"/commit/", status=503, times=2, retry_after=1)
        hub.hang("HEAD", r"/resolve/", seconds=5)       # answers late (then normally)
        hub.drop("GET", r"/resolve/", times=1)          # closes without an answer
        ...
        hub.requests  # [RequestRecord(method, path, range, status, fault), ...]

Quotas emulate the Hub's rate limits, scaled down for tests: a commit quota and a request
quota over one rolling window (``None`` is unlimited, the default)::

    hub.set_quota(commits=10, requests=None, window_s=5.0)  # 10 commits per rolling 5 s
    # or LocalHubServer(..., quota=Quota(commits=10, window_s=5.0))

* A request counts against a quota when it is admitted: the commit quota counts
  ``POST /api/<type>s/<repo>/commit/<rev>``; the request quota counts every request, of
  every kind (the Hub keeps separate buckets for API calls and resolvers; one bucket keeps
  the emulation simple), commits included.
* When a quota is used up in the last ``window_s`` seconds, the request is answered ``429``
  with ``Retry-After`` (whole seconds, at least 1: the ceiling of the time until a counted
  request leaves the window) and a JSON error in the Hub's words: ``{"error": "You have
  exceeded our hourly quotas for action: commit. We invite you to retry later."}`` for the
  commit quota; ``{"error": "We had to rate limit you, you hit the quota of N requests per
  S seconds period. ..."}`` for the request quota, which also sends the Hub's
  ``RateLimit``/``RateLimit-Policy`` headers (IETF draft; the bucket is ``"resolvers"``
  for a resolver request, else ``"api"``). A throttled request counts against no quota.
* Quotas apply after injected faults and after the token check: the Hub limits an account,
  so a request refused ``401`` counts against no quota (without ``token=``, every request
  is the one anonymous caller's).
* ``set_quota`` replaces the quota and starts counting afresh.

Every request has a kind, in ``RequestRecord.kind``: ``"commit"`` (``POST .../commit/...``),
``"resolver"`` (``HEAD``/``GET .../resolve/...``), ``"api"`` (any other ``/api/`` request)
or ``"other"``. ``hub.counts()`` tallies the request log by kind, whatever the answer, plus
``"throttled"``: the requests a quota answered ``429`` (``RequestRecord.throttled`` names
the quota, ``"commits"`` or ``"requests"``)::

    hub.counts()  # {"api": 3, "resolver": 5, "commit": 12, "other": 0, "throttled": 2}

The tallies come from the request log, so ``clear_requests()`` resets them.

Network conditions emulate a CDN's link, for benchmarks: a bandwidth cap per connection
and a latency per request (``None``/``0``, the default, is today's loopback speed, with no
pacing code on the path at all)::

    hub.set_network(bandwidth_bps=1 << 20, latency_s=0.05)  # 1 MiB/s each, 50 ms each
    # or LocalHubServer(..., network=Network(bandwidth_bps=1 << 20, latency_s=0.05))

* ``bandwidth_bps`` caps every response body, per connection: each answer's body is sent
  in chunks (at most 64 KiB, and at most 50 ms' worth), each chunk only once
  ``bytes sent / time since the body started`` would stay within the cap. Connections
  are paced independently (no shared bucket, no global lock), so ``n`` parallel or ranged
  connections get ``n`` times the bandwidth, as from a CDN. Headers and uploads (request
  bodies) are not paced.
* ``latency_s`` delays every answer (``HEAD``, ``GET`` and API calls alike, faults and
  refusals included) once, before anything is sent; requests wait in parallel.
* A request takes the conditions in force when it arrives; ``set_network`` does not
  change answers already under way. Stopping the server cuts a paced body or a latency
  wait short at once (the connection is closed).

The pytest plugin of this package (``fsm.testing.pytest_plugin``, loaded explicitly)
provides the ``hub_server`` fixture built on this class.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

__all__ = ["Fault", "LastCommit", "LocalHubServer", "Network", "Quota", "RequestRecord",
           "hub_date", "request_kind"]

RepoType = Literal["model", "dataset", "space"]
FaultKind = Literal["fail", "hang", "drop"]
RequestKind = Literal["api", "resolver", "commit", "other"]
QuotaName = Literal["commits", "requests"]

_CHUNK = 1 << 20
#: Entries per page of a tree listing, as the Hub answers them (with ``expand=true``: 50).
TREE_PAGE = 1000
EXPANDED_TREE_PAGE = 50
#: Commits per page of a repo's history, as the Hub answers them.
COMMITS_PAGE = 50
_PACE_CHUNK = 64 << 10  # the most a paced body sends at once
_PACE_SLICE_S = 0.05  # ... and at most this long's worth of the cap, so slow caps stay smooth
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_API = re.compile(
    r"^/api/(?P<type>models|datasets|spaces)/" + _REPO
    + r"/(?P<op>revision|tree|preupload|commit|commits|paths-info)/(?P<rest>.+)$"
)
_INFO = re.compile(r"^/api/(?P<type>models|datasets|spaces)/" + _REPO + r"/?$")
_REFS = re.compile(r"^/api/(?P<type>models|datasets|spaces)/" + _REPO + r"/refs/?$")
_RESOLVE = re.compile(r"^/(?:(?P<type>datasets|spaces)/)?" + _REPO + r"/resolve/(?P<rest>.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_OLD_CLIENT = re.compile(r"\bhf_hub/0\.")


@dataclass(frozen=True)
class LastCommit:
    """A commit (a file's last, or one of a repo's history): when (the server's clock),
    its title, its id."""

    when: float
    title: str
    sha: str

    def payload(self) -> dict[str, str]:
        """As the Hub's ``lastCommit`` of an expanded listing."""
        return {"id": self.sha, "title": self.title, "date": hub_date(self.when)}


def hub_date(when: float) -> str:
    """``when`` (seconds since the epoch) as the Hub writes a date: ISO 8601 in UTC with
    milliseconds (truncated) and ``Z``."""
    millis = math.floor(when * 1000)
    seconds, rest = divmod(millis, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{rest:03d}Z"


@dataclass
class RequestRecord:
    """One request the server saw. ``status`` is None while it is pending or when dropped."""

    method: str
    path: str
    query: str
    range: str | None
    status: int | None = None
    fault: FaultKind | None = None
    at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None  # when the answer (body included) was sent or dropped
    #: ``"commit"``, ``"resolver"``, ``"api"`` or ``"other"``: derived from method and path
    #: (:func:`request_kind`) when not given, so it is never None once constructed.
    kind: RequestKind | None = None
    #: The quota that answered it ``429`` (``"commits"`` or ``"requests"``), else None.
    throttled: QuotaName | None = None
    #: Whether it carried an ``Authorization`` header (its value is never recorded).
    authorization: bool = False

    def __post_init__(self) -> None:
        if self.kind is None:
            self.kind = request_kind(self.method, self.path)


def request_kind(method: str, path: str) -> RequestKind:
    """The kind of a request, as the quotas and ``counts()`` see it.

    ``"commit"``: ``POST /api/<type>s/<repo>/commit/<rev>``; ``"resolver"``: ``HEAD`` or
    ``GET`` of ``/{<type>s/}<repo>/resolve/<rev>/<path>``; ``"api"``: any other request
    below ``/api/``; ``"other"``: the rest.
    """
    method = method.upper()
    api = _API.match(path)
    if api is not None and api["op"] == "commit" and method == "POST":
        return "commit"
    if path == "/api" or path.startswith("/api/"):
        return "api"
    if _RESOLVE.match(path) is not None and method in ("GET", "HEAD"):
        return "resolver"
    return "other"


@dataclass(frozen=True)
class Quota:
    """Quotas over a rolling window of ``window_s`` seconds; None is unlimited.

    ``commits``: commits admitted per window; ``requests``: requests of any kind admitted
    per window (commits included). ``0`` refuses every request the quota counts.
    """

    commits: int | None = None
    requests: int | None = None
    window_s: float = 300.0
    #: Whether a 429 carries ``Retry-After``; False: only ``RateLimit``/``RateLimit-Policy``
    #: (``"api";r=0;t=<seconds to reset>``), as the Hub's request quota may answer.
    retry_after: bool = True

    def __post_init__(self) -> None:
        for name in ("commits", "requests"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be None or an integer >= 0, not {value!r}")
        if not (isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s)
                and self.window_s > 0):
            raise ValueError(f"window_s must be a positive number, not {self.window_s!r}")

    @property
    def unlimited(self) -> bool:
        return self.commits is None and self.requests is None


@dataclass(frozen=True)
class Network:
    """Network conditions: a bandwidth cap per connection and a latency per request.

    ``bandwidth_bps``: bytes per second each response body is sent at, at most, on each
    connection (None: unlimited). ``latency_s``: seconds every answer waits before it is
    sent (0: none). ``Network()``, the default, changes nothing.

    Servers other than :class:`LocalHubServer` can reuse it (the test suite's package index
    does): call :meth:`delay` before answering and :meth:`send` for the body.
    """

    bandwidth_bps: float | None = None
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        bps = self.bandwidth_bps
        if bps is not None and (isinstance(bps, bool) or not isinstance(bps, (int, float))
                                or not math.isfinite(bps) or bps <= 0):
            raise ValueError(f"bandwidth_bps must be None or a positive number, not {bps!r}")
        lat = self.latency_s
        if (isinstance(lat, bool) or not isinstance(lat, (int, float))
                or not math.isfinite(lat) or lat < 0):
            raise ValueError(f"latency_s must be a number >= 0, not {lat!r}")

    @property
    def unlimited(self) -> bool:
        """True when nothing is emulated: no cap and no latency."""
        return self.bandwidth_bps is None and not self.latency_s

    def delay(self, stop: threading.Event) -> bool:
        """Wait ``latency_s``: True once it has passed, False if ``stop`` was set first."""
        if not self.latency_s:
            return not stop.is_set()
        return not stop.wait(self.latency_s)

    def send(
        self,
        write: Callable[[bytes], object],
        body: bytes | BinaryIO,
        stop: threading.Event,
        length: int | None = None,
    ) -> bool:
        """Send ``body`` through ``write`` within the cap; False if ``stop`` cut it short.

        ``body`` is bytes, or a binary file read from its current position (``length``
        bytes, required for a file; at most ``length`` bytes of bytes). Each chunk (at
        most 64 KiB, and at most 50 ms' worth of the cap) is written only once the bytes
        sent, that chunk included, divided by the time since the body started are within
        the cap: ``bytes / elapsed`` never exceeds ``bandwidth_bps``, and a late wake-up is
        made up by the next chunks rather than lost. The waits are on ``stop``, so setting
        it ends them at once. Without a cap the body is written at once.
        """
        if isinstance(body, bytes):
            view = memoryview(body)[:length]
            total = len(view)

            def read(offset: int, size: int) -> bytes:
                return bytes(view[offset:offset + size])
        else:
            if length is None:
                raise ValueError("length is required to send a file")
            total = length
            source = body

            def read(offset: int, size: int) -> bytes:
                return source.read(size)

        bps = self.bandwidth_bps
        if bps is None:
            if isinstance(body, bytes):
                write(body if length is None else body[:length])
                return True
            while total > 0 and not stop.is_set():
                data = body.read(min(_CHUNK, total))
                if not data:
                    break
                write(data)
                total -= len(data)
            return not stop.is_set()
        chunk = max(1, min(_PACE_CHUNK, int(bps * _PACE_SLICE_S)))
        started = time.monotonic()
        sent = 0
        while sent < total:
            size = min(chunk, total - sent)
            wait = started + (sent + size) / bps - time.monotonic()
            if (wait > 0 and stop.wait(wait)) or stop.is_set():
                return False
            data = read(sent, size)
            if not data:
                break  # a file shorter than announced: the client sees a short body
            write(data)
            sent += len(data)
        return True


@dataclass(frozen=True)
class _Throttle:
    """A quota's refusal: the 429 to answer."""

    quota: QuotaName
    message: str
    headers: dict[str, str]


@dataclass
class Fault:
    """An injected fault; ``hits`` counts the requests it has hit so far."""

    kind: FaultKind
    method: str
    pattern: re.Pattern[str]
    times: int
    status: int = 503
    retry_after: float | str | None = None
    error_code: str | None = None
    seconds: float = 0.0
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            self.hits < self.times
            and self.method in ("*", method)
            and self.pattern.search(path) is not None
        )


class LocalHubServer:
    """A Hub API server on ``127.0.0.1`` for tests; a context manager.

    ``root`` holds the repos (a fresh temporary directory, removed on stop, when None).
    ``token``: when given, every request must carry ``Authorization: Bearer <token>``.
    ``quota``: the commit and request quotas (unlimited when None); see :meth:`set_quota`.
    ``network``: a bandwidth cap per connection and a latency per request (none when
    None); see :meth:`set_network`.
    """

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_file: Path | str | None = None,
        quota: Quota | None = None,
        network: Network | None = None,
        tls: tuple[Path | str, Path | str] | None = None,
    ) -> None:
        self._own_root = root is None
        self._tls = tls
        self._redirector: ThreadingHTTPServer | None = None
        self.root = Path(tempfile.mkdtemp(prefix="hubserver-")) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._token = token
        self._host = host
        self._port = port
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._faults: list[Fault] = []
        self._log: list[RequestRecord] = []
        self._write_lock = threading.Lock()
        self._generation: dict[Path, int] = {}
        # Per repo: each file's last commit, and when the repo last took one.
        self._last_commits: dict[Path, dict[str, LastCommit]] = {}
        self._head_times: dict[Path, float] = {}
        # Per repo: every commit (when, title, id), in the order they were applied.
        self._history: dict[Path, list[LastCommit]] = {}
        self._etags: dict[tuple[str, int, int], str] = {}
        self._log_file = Path(log_file) if log_file is not None else None
        self._quota = Quota() if quota is None else quota
        self._network = Network() if network is None else network
        self._content_origin: str | None = None
        self._upload_modes: list[tuple[re.Pattern[str], str]] = []
        self._renamed: dict[tuple[RepoType, str], str] = {}
        self._tree_page = TREE_PAGE
        # Admission times (monotonic) of the requests counted in the current window.
        self._admitted: dict[QuotaName, deque[float]] = {"commits": deque(), "requests": deque()}

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The endpoint to hand the client, e.g. ``http://127.0.0.1:41234``."""
        if self._httpd is None:
            raise RuntimeError("the server is not running: call start() or use it as a context")
        host, port = self._httpd.server_address[:2]
        return f"{'https' if self._tls else 'http'}://{host!s}:{port}"

    @property
    def http_url(self) -> str:
        """A plain-HTTP endpoint on the same host that answers every request, whatever its
        method, with ``308`` to the same path at :attr:`url` (a server built with ``tls=``:
        an ``http://`` endpoint redirecting to ``https://``). Started on first use."""
        if self._httpd is None:
            raise RuntimeError("the server is not running: call start() or use it as a context")
        if self._redirector is None:
            target = self.url

            class Redirect(BaseHTTPRequestHandler):
                protocol_version = "HTTP/1.1"

                def log_message(self, format: str, *args: Any) -> None:
                    pass

                def _redirect(self) -> None:
                    length = int(self.headers.get("Content-Length") or 0)
                    if length:
                        self.rfile.read(length)
                    body = b"Permanent Redirect"
                    self.send_response(308)
                    self.send_header("Location", target + self.path)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)

                do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _redirect  # noqa: N815  # the handler API

            redirector = ThreadingHTTPServer((self._host, 0), Redirect)
            redirector.daemon_threads = True
            threading.Thread(target=redirector.serve_forever, kwargs={"poll_interval": 0.05},
                             name="local-hub-redirect", daemon=True).start()
            self._redirector = redirector
        host, port = self._redirector.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> LocalHubServer:
        if self._httpd is not None:
            return self
        self._stopping.clear()
        httpd = _Server((self._host, self._port), _Handler)
        httpd.hub = self
        if self._tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(self._tls[0]), str(self._tls[1]))
            httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
            name="local-hub-server", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; hung requests are released at once. Idempotent."""
        self._stopping.set()
        redirector, self._redirector = self._redirector, None
        if redirector is not None:
            redirector.shutdown()
            redirector.server_close()
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalHubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- repos --------------------------------------------------------------------------

    def repo_dir(self, repo_id: str, repo_type: RepoType = "dataset") -> Path:
        """The directory holding repo ``repo_id`` (it may not exist yet)."""
        parts = repo_id.split("/")
        if not 1 <= len(parts) <= 2 or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"not a repo id: {repo_id!r}")
        return self.root.joinpath(f"{repo_type}s", *parts)

    def create_repo(self, repo_id: str, repo_type: RepoType = "dataset") -> Path:
        """Create an empty repo (idempotent) and return its directory. A new repo's
        ``lastModified`` is its creation (the Hub's initial commit)."""
        path = self.repo_dir(repo_id, repo_type)
        with self._write_lock:
            if not path.is_dir():
                path.mkdir(parents=True, exist_ok=True)
                self._head_times[path] = now = time.time()
                self._history[path] = [LastCommit(now, "initial commit", self._commit_of(path))]
        return path

    def add_file(
        self,
        repo_id: str,
        path_in_repo: str,
        data: bytes | str | Path,
        repo_type: RepoType = "dataset",
        *,
        when: float | None = None,
    ) -> Path:
        """Put a file straight into a repo (created when missing), bypassing the API: a
        commit of its own, dated ``when`` (seconds since the epoch; now when None), which
        becomes the file's ``lastCommit`` and the repo's ``lastModified``."""
        target = _join(self.create_repo(repo_id, repo_type), path_in_repo)
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._write_lock:
            if isinstance(data, Path):
                shutil.copyfile(data, target)
            else:
                target.write_bytes(data.encode() if isinstance(data, str) else data)
            self._committed(self.repo_dir(repo_id, repo_type), [path_in_repo.strip("/")], [],
                            f"Upload {path_in_repo.strip('/')}", when)
        self.etag(target)  # hash now, not on the first request
        return target

    def last_commit(self, repo_id: str, path_in_repo: str,
                    repo_type: RepoType = "dataset") -> LastCommit:
        """The last commit that wrote ``path_in_repo`` (a file put there behind the
        server's back: its modification time, no title, the repo's current commit)."""
        repo = self.repo_dir(repo_id, repo_type)
        return self._last_change(repo, path_in_repo.strip("/"), _join(repo, path_in_repo))

    def last_modified(self, repo_id: str, repo_type: RepoType = "dataset") -> float:
        """When the repo last took a commit (its ``lastModified``), by the server's clock."""
        return self._repo_time(self.repo_dir(repo_id, repo_type))

    def rename_repo(self, old_id: str, new_id: str, repo_type: RepoType = "dataset") -> Path:
        """Move repo ``old_id`` to ``new_id``; from now on the old name is answered, for every
        method, with ``307`` to the same path under the new name, as the Hub does."""
        old, new = self.repo_dir(old_id, repo_type), self.repo_dir(new_id, repo_type)
        new.parent.mkdir(parents=True, exist_ok=True)
        with self._write_lock:
            os.replace(old, new)
            self._renamed[(repo_type, old_id)] = new_id
            if old in self._last_commits:  # its history goes with it
                self._last_commits[new] = self._last_commits.pop(old)
            if old in self._head_times:
                self._head_times[new] = self._head_times.pop(old)
            if old in self._history:
                self._history[new] = self._history.pop(old)
        return new

    def _canonical(self, repo_type: RepoType, repo_id: str) -> str | None:
        """The repo's own id when ``repo_id`` names it otherwise (another case, an old
        name), else None (the id is the repo's, or names none)."""
        try:
            if self.repo_dir(repo_id, repo_type).is_dir():
                return None
        except ValueError:
            return None
        renamed = self._renamed.get((repo_type, repo_id))
        if renamed is not None:
            return renamed
        base = self.root / f"{repo_type}s"
        found: list[str] = []
        for part in repo_id.split("/"):
            try:
                match = next((p.name for p in sorted(base.iterdir())
                              if p.is_dir() and p.name.lower() == part.lower()), None)
            except OSError:
                return None
            if match is None:
                return None
            found.append(match)
            base = base / match
        return "/".join(found)

    def commit_sha(self, repo_id: str, repo_type: RepoType = "dataset") -> str:
        """The repo's current commit id (40 hex), derived from its content listing."""
        return self._commit_of(self.repo_dir(repo_id, repo_type))

    # --- faults -------------------------------------------------------------------------

    def fail(
        self,
        method: str,
        path_regex: str,
        status: int = 503,
        times: int = 1,
        retry_after: float | str | None = None,
        error_code: str | None = None,
    ) -> Fault:
        """Answer ``status`` to the first ``times`` requests matching method and path."""
        return self._add(Fault("fail", method.upper(), re.compile(path_regex), times,
                               status=status, retry_after=retry_after, error_code=error_code))

    def hang(self, method: str, path_regex: str, seconds: float, times: int = 1) -> Fault:
        """Hold the first ``times`` matching requests ``seconds`` (or until stop); then serve."""
        return self._add(Fault("hang", method.upper(), re.compile(path_regex), times,
                               seconds=seconds))

    def drop(self, method: str, path_regex: str, times: int = 1) -> Fault:
        """Close the connection of the first ``times`` matching requests without an answer."""
        return self._add(Fault("drop", method.upper(), re.compile(path_regex), times))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    # --- listings -----------------------------------------------------------------------

    def set_tree_page(self, size: int = 0) -> None:
        """Answer tree listings in pages of ``size`` entries (the Hub's own: 1,000; 0 is
        that default; an expanded listing's pages are at most 50), each page but the last
        with a ``Link: <...&cursor=...>; rel="next"`` header, as the Hub paginates."""
        with self._lock:
            self._tree_page = size if size > 0 else TREE_PAGE

    # --- quotas -------------------------------------------------------------------------

    @property
    def quota(self) -> Quota:
        """The quotas in force (``Quota()``, unlimited, by default)."""
        with self._lock:
            return self._quota

    def set_quota(
        self, commits: int | None = None, requests: int | None = None, window_s: float = 300.0,
        *, retry_after: bool = True,
    ) -> Quota:
        """Limit commits and requests (any kind) admitted per rolling ``window_s`` seconds.

        None is unlimited (``set_quota()`` lifts every quota). Counting starts afresh: what
        was admitted before this call counts against no quota. A request over a quota is
        answered ``429`` with ``Retry-After``, and counts against none.
        """
        quota = Quota(commits=commits, requests=requests, window_s=window_s,
                      retry_after=retry_after)
        with self._lock:
            self._quota = quota
            for admitted in self._admitted.values():
                admitted.clear()
        return quota

    # --- network conditions -------------------------------------------------------------

    @property
    def network(self) -> Network:
        """The network conditions in force (``Network()``, none, by default)."""
        return self._network

    def answer_preupload(self, path_regex: str, mode: Literal["lfs", "ignored"]) -> None:
        """From now on, ``preupload`` answers ``uploadMode: lfs`` (or ``shouldIgnore:
        true``, a ``.gitignore`` match) for the paths ``path_regex`` matches, as the Hub
        does for a repo's LFS patterns; the server implements no LFS transfer itself."""
        self._upload_modes.append((re.compile(path_regex), mode))

    def redirect_content(self, origin: str | None) -> None:
        """Answer a file's resolve (``GET``/``HEAD``) with ``302`` to the same path at
        ``origin`` (another server: a CDN), as the Hub does for LFS files, with the
        ``X-Linked-Etag`` (the content's sha256) and ``X-Linked-Size`` it sends then.
        None: serve the content itself again."""
        self._content_origin = origin.rstrip("/") if origin else None

    def set_network(
        self, bandwidth_bps: float | None = None, latency_s: float = 0.0
    ) -> Network:
        """Cap each connection's response bodies at ``bandwidth_bps`` bytes per second
        (None: unlimited) and delay every answer by ``latency_s`` seconds.

        ``set_network()`` lifts both. Requests that arrive after the call see the new
        conditions; answers already under way keep theirs.
        """
        network = Network(bandwidth_bps=bandwidth_bps, latency_s=latency_s)
        self._network = network  # one reference swap: handlers read it without a lock
        return network

    def counts(self) -> dict[str, int]:
        """Requests in the log by kind, whatever their answer, and the ``throttled`` ones.

        ``{"api": n, "resolver": n, "commit": n, "other": n, "throttled": n}``;
        ``clear_requests()`` resets them with the log.
        """
        tally = {"api": 0, "resolver": 0, "commit": 0, "other": 0, "throttled": 0}
        with self._lock:
            for record in self._log:
                tally[record.kind or request_kind(record.method, record.path)] += 1
                if record.throttled is not None:
                    tally["throttled"] += 1
        return tally

    # --- the request log ----------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of every request seen so far, oldest first."""
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    def wait_for(
        self, predicate: Callable[[list[RequestRecord]], bool], timeout: float = 5.0
    ) -> bool:
        """Block until ``predicate(requests)`` holds (True) or ``timeout`` passes (False)."""
        end = time.monotonic() + timeout
        with self._changed:
            while not predicate(list(self._log)):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    # --- internals used by the handler --------------------------------------------------

    def _add(self, fault: Fault) -> Fault:
        if fault.times < 1:
            raise ValueError("times must be at least 1")
        with self._lock:
            self._faults.append(fault)
        return fault

    def _record(self, record: RequestRecord) -> Fault | None:
        with self._changed:
            self._log.append(record)
            fault = next((f for f in self._faults if f.matches(record.method, record.path)), None)
            if fault is not None:
                fault.hits += 1
                record.fault = fault.kind
            self._changed.notify_all()
            return fault

    def _finish(self, record: RequestRecord, status: int | None) -> None:
        with self._changed:
            record.status = status
            self._changed.notify_all()

    def _ended(self, record: RequestRecord) -> None:
        with self._changed:
            record.ended_at = time.monotonic()
            self._changed.notify_all()
            if self._log_file is not None:
                line = dict(vars(record))
                with self._log_file.open("a") as f:
                    f.write(json.dumps(line) + "\n")

    def _admit(self, record: RequestRecord) -> _Throttle | None:
        """Count an authorized request against the quotas, or say why it is refused."""
        with self._changed:
            quota = self._quota
            if quota.unlimited:
                return None
            now = time.monotonic()
            limits: list[tuple[QuotaName, int]] = []
            if quota.commits is not None and record.kind == "commit":
                limits.append(("commits", quota.commits))
            if quota.requests is not None:
                limits.append(("requests", quota.requests))
            refused: tuple[float, QuotaName, int] | None = None
            for name, limit in limits:
                admitted = self._admitted[name]
                while admitted and admitted[0] <= now - quota.window_s:
                    admitted.popleft()
                if len(admitted) < limit:
                    continue
                # A place frees when the entry `limit` from the newest leaves the window.
                freed = admitted[len(admitted) - limit] + quota.window_s if limit else None
                wait = quota.window_s if freed is None else freed - now
                if refused is None or wait > refused[0]:
                    refused = (wait, name, limit)
            if refused is None:
                for name, _limit in limits:
                    self._admitted[name].append(now)
                return None
            wait, name, limit = refused
            record.throttled = name
            self._changed.notify_all()
        retry_after = max(1, math.ceil(wait))
        headers = {"Retry-After": str(retry_after)}
        if name == "commits":
            message = ("You have exceeded our hourly quotas for action: commit. "
                       "We invite you to retry later.")
        else:
            bucket = "resolvers" if record.kind == "resolver" else "api"
            message = (f"We had to rate limit you, you hit the quota of {limit} requests per "
                       f"{quota.window_s:g} seconds period. "
                       "See https://huggingface.co/docs/hub/rate-limits")
            headers["RateLimit"] = f'"{bucket}";r=0;t={retry_after}'
            headers["RateLimit-Policy"] = (
                f'"rolling window";"{bucket}";q={limit};w={math.ceil(quota.window_s)}')
            if not quota.retry_after:
                del headers["Retry-After"]
        return _Throttle(name, message, headers)

    def _authorized(self, header: str | None) -> bool:
        return self._token is None or header == f"Bearer {self._token}"

    def _bump(self, repo: Path) -> None:
        self._generation[repo] = self._generation.get(repo, 0) + 1

    def _committed(self, repo: Path, written: list[str], deleted: list[str], title: str,
                   when: float | None = None) -> str:
        """A commit was applied to ``repo`` (under the write lock): a new commit id, dated
        ``when`` (now when None), the last commit of every path it wrote; the records of
        what it deleted (a folder: everything below it) go. Returns the commit id."""
        now = time.time() if when is None else when
        self._bump(repo)
        sha = self._commit_of(repo)
        records = self._last_commits.setdefault(repo, {})
        for rel in deleted:
            for key in [k for k in records if k == rel or k.startswith(f"{rel}/")]:
                del records[key]
        for rel in written:
            records[rel] = LastCommit(now, title, sha)
        self._head_times[repo] = now
        self._history.setdefault(repo, []).append(LastCommit(now, title, sha))
        return sha

    def _last_change(self, repo: Path, rel: str, path: Path) -> LastCommit:
        """The last commit of the file ``rel`` (at ``path``); for a folder, the newest of
        its files'."""
        if path.is_dir():
            found = [self._last_change(repo, f"{rel}/{sub}", file)
                     for sub, file in self._files(path)]
            return max(found, key=lambda commit: commit.when,
                       default=LastCommit(path.stat().st_mtime, "", self._commit_of(repo)))
        record = self._last_commits.get(repo, {}).get(rel)
        if record is not None:
            return record
        return LastCommit(path.stat().st_mtime, "", self._commit_of(repo))

    def _repo_time(self, repo: Path) -> float:
        """When ``repo`` last took a commit: the newest file's modification time for a
        repo the server saw no commit of."""
        known = self._head_times.get(repo)
        if known is not None:
            return known
        return max((path.stat().st_mtime for _, path in self._files(repo)),
                   default=repo.stat().st_mtime)

    def _files(self, repo: Path) -> Iterator[tuple[str, Path]]:
        for dirpath, dirnames, filenames in os.walk(repo):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath, name)
                yield path.relative_to(repo).as_posix(), path

    def _commit_of(self, repo: Path) -> str:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"{repo.as_posix()}\0{self._generation.get(repo, 0)}\n".encode())
        for rel, path in self._files(repo):
            st = path.stat()
            digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return digest.hexdigest()

    def etag(self, path: Path) -> str:
        """The git blob id of a file (what the Hub sends as ETag of a regular file)."""
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._etags.get(key)
        if cached is not None:
            return cached
        digest = hashlib.sha1(f"blob {st.st_size}\0".encode(), usedforsecurity=False)
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        value = digest.hexdigest()
        with self._lock:
            self._etags[key] = value
        return value


def _join(repo: Path, path_in_repo: str) -> Path:
    parts = path_in_repo.strip("/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a repo path: {path_in_repo!r}")
    return repo.joinpath(*parts)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 64  # a burst of parallel clients is not left waiting on SYN retries
    hub: LocalHubServer


class _HttpError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body leave in separate writes: with Nagle's algorithm on, the body waits
    # for the client's delayed ACK of the headers (about 40 ms on Linux), a stall the
    # Hub's own front end does not have.
    disable_nagle_algorithm = True
    server: _Server
    _record: RequestRecord
    _body: bytes
    _network: Network = Network()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the server's record, not stderr

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    # --- plumbing -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        hub = self.server.hub
        split = urlsplit(self.path)
        record = RequestRecord(self.command, split.path, split.query, self.headers.get("Range"),
                               authorization="Authorization" in self.headers)
        self._record = record
        try:
            self._body = self._read_body()
        except (OSError, ValueError):
            self.close_connection = True
            hub._record(record)
            hub._ended(record)
            return
        fault = hub._record(record)
        try:
            self._answer(split.path, split.query, fault)
        finally:
            hub._ended(record)

    def _answer(self, path: str, query: str, fault: Fault | None) -> None:
        hub = self.server.hub
        record = self._record
        # The conditions when the request arrived, for the whole answer.
        self._network = network = hub._network
        try:
            if network.latency_s and not network.delay(hub._stopping):
                self._drop()  # the server is stopping
                return
            if fault is not None and fault.kind == "drop":
                self._drop()
                return
            if fault is not None and fault.kind == "hang":
                hub._stopping.wait(fault.seconds)
                if hub._stopping.is_set():
                    self._drop()
                    return
            if fault is not None and fault.kind == "fail":
                headers = {}
                if fault.retry_after is not None:
                    headers["Retry-After"] = str(fault.retry_after)
                self._send_json(fault.status, {"error": "injected fault"}, headers,
                                error_code=fault.error_code)
                return
            if not hub._authorized(self.headers.get("Authorization")):
                # Like the Hub: no error code, a message that never echoes the header.
                self._send_json(401, {"error": "Invalid credentials in Authorization header"})
                return
            throttle = hub._admit(record)
            if throttle is not None:
                self._send_json(429, {"error": throttle.message}, throttle.headers)
                return
            if not self._redirect_to_canonical(path, query):
                self._route(path, parse_qs(query))
        except _HttpError as err:
            self._send_json(err.status, {"error": err.message}, error_code=err.error_code)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            if record.status is None:
                hub._finish(record, 499)  # the client went away mid-answer

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            body = b"".join(chunks)
        else:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
        if self.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        return body

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        self.server.hub._finish(self._record, None)

    def _cut(self) -> None:
        """Close the connection mid-body (the server is stopping); the status stands."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _write_body(self, body: bytes | BinaryIO, length: int | None = None) -> None:
        """Write a response body, paced when the request's network has a cap."""
        if not self._network.send(self.wfile.write, body, self.server.hub._stopping, length):
            self._cut()

    def _start(self, status: int, headers: dict[str, str], error_code: str | None = None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if error_code:
            self.send_header("X-Error-Code", error_code)
        # Recorded before the headers leave: a client that has its answer finds it logged.
        self.server.hub._finish(self._record, status)
        self.end_headers()

    def _send_json(
        self,
        status: int,
        payload: object,
        headers: dict[str, str] | None = None,
        *,
        error_code: str | None = None,
    ) -> None:
        body = json.dumps(payload).encode()
        self._start(status, {"Content-Type": "application/json",
                             "Content-Length": str(len(body)), **(headers or {})}, error_code)
        if self.command != "HEAD":
            if self._network.bandwidth_bps is None:
                self.wfile.write(body)
            else:
                self._write_body(body)

    # --- routes -------------------------------------------------------------------------

    def _redirect_to_canonical(self, path: str, query: str) -> bool:
        """A repo id in another case, or an old name: ``307`` to the same path under the
        repo's own id, path-only ``Location`` and a text body, whatever the method (the
        Hub's answer; a client follows it with method and body)."""
        match = (_RESOLVE.match(path) or _REFS.match(path) or _INFO.match(path)
                 or _API.match(path))
        if match is None:
            return False
        type_plural = match["type"] or "models"
        canonical = self.server.hub._canonical(_singular(type_plural), unquote(match["repo"]))
        if canonical is None:
            return False
        start, end = match.span("repo")
        location = path[:start] + canonical + path[end:] + (f"?{query}" if query else "")
        body = f"Temporary Redirect. Redirecting to {location}".encode()
        self._start(307, {"Location": location, "Content-Type": "text/plain; charset=utf-8",
                          "Content-Length": str(len(body))})
        if self.command != "HEAD":
            self.wfile.write(body)
        return True

    def _route(self, path: str, query: dict[str, list[str]]) -> None:
        if match := _RESOLVE.match(path):
            if self.command not in ("GET", "HEAD"):
                raise _HttpError(405, "method not allowed")
            repo = self._repo(match["type"] or "models", match["repo"])
            _rev, _, file_path = match["rest"].partition("/")
            self._resolve(repo, unquote(file_path))
            return
        if (match := _REFS.match(path)) and self.command == "GET":
            sha = self.server.hub._commit_of(self._repo(match["type"], match["repo"]))
            self._send_json(200, {
                "branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": sha}],
                "converts": [], "tags": [],
            })
            return
        if (match := _INFO.match(path)) and self.command == "GET":
            self._revision(self._repo(match["type"], match["repo"]), unquote(match["repo"]),
                           query)
            return
        if match := _API.match(path):
            repo = self._repo(match["type"], match["repo"])
            rest = match["rest"]
            op = match["op"]
            if op == "revision" and self.command == "GET":
                self._revision(repo, unquote(match["repo"]), query)
            elif op == "tree" and self.command == "GET":
                _rev, _, sub = rest.partition("/")
                recursive = _true(query, "recursive")
                self._tree(repo, unquote(sub).strip("/"), recursive, query)
            elif op == "commits" and self.command == "GET":
                self._commits(repo, query)
            elif op == "paths-info" and self.command == "POST":
                self._paths_info(repo)
            elif op == "preupload" and self.command == "POST":
                self._preupload(repo)
            elif op == "commit" and self.command == "POST":
                self._commit(repo, match["type"], unquote(match["repo"]))
            else:
                raise _HttpError(405, "method not allowed")
            return
        raise _HttpError(404, "not found")

    def _repo(self, type_plural: str, repo_id: str) -> Path:
        try:
            repo = self.server.hub.repo_dir(unquote(repo_id), _singular(type_plural))
        except ValueError:
            raise _HttpError(400, "invalid repo id") from None
        if not repo.is_dir():
            raise _HttpError(404, "Repository not found", "RepoNotFound")
        return repo

    def _resolve(self, repo: Path, file_path: str) -> None:
        hub = self.server.hub
        try:
            target = _join(repo, file_path)
        except ValueError:
            raise _HttpError(400, "invalid path") from None
        if not target.is_file():
            raise _HttpError(404, "Entry not found", "EntryNotFound")
        size = target.stat().st_size
        etag = hub.etag(target)
        if hub._content_origin is not None:
            self._start(302, {
                "Location": hub._content_origin + self.path,
                "X-Repo-Commit": hub._commit_of(repo),
                "ETag": f'"{etag}"',
                "X-Linked-Etag": f'"{hashlib.sha256(target.read_bytes()).hexdigest()}"',
                "X-Linked-Size": str(size),
                "Content-Length": "0",
            })
            return
        headers = {
            "X-Repo-Commit": hub._commit_of(repo),
            "ETag": f'"{etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        start, end = 0, size - 1
        status = 200
        wanted = self.headers.get("Range")
        if wanted and self.command == "GET":
            parsed = _parse_range(wanted, size)
            if parsed is None:
                self._start(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
                return
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(max(0, end - start + 1))
        self._start(status, headers)
        if self.command == "HEAD" or end < start:
            return
        with target.open("rb") as f:
            if self._network.bandwidth_bps is None:
                self.connection.sendfile(f, start, end - start + 1)
            else:
                f.seek(start)
                self._write_body(f, end - start + 1)

    def _revision(self, repo: Path, repo_id: str, query: dict[str, list[str]]) -> None:
        hub = self.server.hub
        files = [rel for rel, _ in hub._files(repo)]
        with hub._write_lock:
            sha = hub._commit_of(repo)
            modified = hub._repo_time(repo)
        info: dict[str, object] = {
            "id": repo_id, "_id": sha[:24], "sha": sha, "private": False, "disabled": False,
            "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "author": repo_id.split("/")[0],
            "lastModified": hub_date(modified),
            "siblings": [{"rfilename": rel} for rel in files],
        }
        # expand=a&expand=b (or expand[]=...): the Hub answers those fields alone, with
        # the repo's ids (a field it does not know of is left out here).
        expand = query.get("expand", []) + query.get("expand[]", [])
        if expand:
            info = {key: value for key, value in info.items()
                    if key in ("id", "_id") or key in expand}
        self._send_json(200, info)

    def _entry(self, repo: Path, path: Path, *, expand: bool) -> dict[str, object]:
        """A tree listing's entry for ``path`` (a file or a folder of ``repo``); with
        ``expand`` its ``lastCommit`` too."""
        hub = self.server.hub
        rel = path.relative_to(repo).as_posix()
        entry: dict[str, object]
        if path.is_dir():
            oid = hashlib.sha1(rel.encode(), usedforsecurity=False).hexdigest()
            entry = {"type": "directory", "oid": oid, "size": 0, "path": rel}
        else:
            entry = {"type": "file", "oid": hub.etag(path), "size": path.stat().st_size,
                     "path": rel}
        if expand:
            entry["lastCommit"] = hub._last_change(repo, rel, path).payload()
        return entry

    def _tree(self, repo: Path, sub: str, recursive: bool,
              query: dict[str, list[str]]) -> None:
        hub = self.server.hub
        base = repo
        if sub:
            try:
                base = _join(repo, sub)
            except ValueError:
                raise _HttpError(400, "invalid path") from None
            if not base.is_dir():
                raise _HttpError(404, "Entry not found", "EntryNotFound")
        expand = _true(query, "expand")
        walker = sorted(base.rglob("*")) if recursive else sorted(base.iterdir())
        with hub._write_lock:  # a commit's records and files together
            entries = [self._entry(repo, path, expand=expand)
                       for path in walker if path.is_dir() or path.is_file()]
        with hub._lock:
            size = hub._tree_page
        if expand:  # the Hub's pages of an expanded listing are smaller
            size = min(size, EXPANDED_TREE_PAGE)
        cursor = query.get("cursor", ["0"])[0]
        start = int(cursor) if cursor.isascii() and cursor.isdigit() else 0
        page, headers = entries[start:start + size], {}
        if start + size < len(entries):
            following = urlencode({**{k: v[0] for k, v in query.items()},
                                   "cursor": str(start + size)})
            headers["Link"] = f'<{hub.url}{urlsplit(self.path).path}?{following}>; rel="next"'
        self._send_json(200, page, headers)

    def _commits(self, repo: Path, query: dict[str, list[str]]) -> None:
        """The repo's commits, newest (by date) first, a page of :data:`COMMITS_PAGE` at a
        time (``p``, from 0), the next page linked as the Hub links it."""
        hub = self.server.hub
        with hub._write_lock:
            history = sorted(hub._history.get(repo, []), key=lambda c: c.when, reverse=True)
        number = query.get("p", ["0"])[0]
        start = (int(number) if number.isascii() and number.isdigit() else 0) * COMMITS_PAGE
        page = [{"id": c.sha, "title": c.title, "message": "", "authors": [{"user": "local"}],
                 "date": hub_date(c.when)} for c in history[start:start + COMMITS_PAGE]]
        headers = {}
        if start + COMMITS_PAGE < len(history):
            following = urlencode({"p": str(start // COMMITS_PAGE + 1)})
            headers["Link"] = f'<{hub.url}{urlsplit(self.path).path}?{following}>; rel="next"'
        self._send_json(200, page, headers)

    def _paths_info(self, repo: Path) -> None:
        """The entries of the paths asked for (a form, as the library sends it, or JSON)
        that exist, in the order asked; the others are left out, as the Hub does."""
        body = self._body.decode("utf-8", "replace")
        try:
            if self.headers.get("Content-Type", "").startswith("application/json"):
                form = json.loads(body or "{}")
                paths = [str(p) for p in form.get("paths", [])]
                expand = form.get("expand") in (True, "true", "True", "1")
            else:
                fields = parse_qs(body)
                paths = fields.get("paths", [])
                expand = _true(fields, "expand")
        except (ValueError, AttributeError, TypeError):
            raise _HttpError(400, "invalid paths-info body") from None
        entries = []
        with self.server.hub._write_lock:
            for wanted in dict.fromkeys(p.strip("/") for p in paths):
                try:
                    path = _join(repo, wanted)
                except ValueError:
                    continue
                if path.is_dir() or path.is_file():
                    entries.append(self._entry(repo, path, expand=expand))
        self._send_json(200, entries)

    def _preupload(self, repo: Path) -> None:
        hub = self.server.hub
        try:
            files = json.loads(self._body or b"{}").get("files", [])
        except (ValueError, AttributeError):
            raise _HttpError(400, "invalid preupload body") from None
        answer = []
        for entry in files:
            path = str(entry.get("path", ""))
            oid = None
            try:
                existing = _join(repo, path)
                if existing.is_file():
                    oid = hub.etag(existing)
            except ValueError:
                raise _HttpError(400, "invalid path") from None
            modes = {mode for pattern, mode in hub._upload_modes if pattern.search(path)}
            ignored = "ignored" in modes or _gitignored(repo, path)
            answer.append({"path": path, "uploadMode": "lfs" if "lfs" in modes else "regular",
                           "shouldIgnore": ignored, "oid": oid})
        self._send_json(200, {"files": answer, "commitOid": hub._commit_of(repo)})

    def _commit(self, repo: Path, type_plural: str, repo_id: str) -> None:
        hub = self.server.hub
        writes: list[tuple[Path, bytes]] = []
        deletes: list[Path] = []
        parent: str | None = None
        title = ""
        try:
            for line in self._body.splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                key, value = item.get("key"), item.get("value", {})
                if key == "header":
                    named = value.get("parentCommit")
                    parent = None if named is None else str(named)
                    title = str(value.get("summary") or "")
                    continue
                if key == "file":
                    content = value["content"]
                    data = (base64.b64decode(content) if value.get("encoding") == "base64"
                            else str(content).encode())
                    writes.append((_join(repo, value["path"]), data))
                elif key in ("deletedFile", "deletedFolder"):
                    deletes.append(_join(repo, value["path"]))
                else:
                    raise _HttpError(400, f"unsupported commit operation {key!r}")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise _HttpError(400, "invalid commit body") from None
        with hub._write_lock:
            if parent is not None and parent != hub._commit_of(repo):
                raise _HttpError(412, "A commit has happened since. Please refresh and try again.")
            # The whole commit or nothing: a deletion of a missing file refuses it first.
            if any(not target.exists() for target in deletes):
                raise _HttpError(404, "A file with this name doesn't exist", "EntryNotFound")
            for target in deletes:
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
                _prune(repo, target.parent)
            for target, data in writes:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                os.replace(tmp, target)
            sha = hub._committed(
                repo, [target.relative_to(repo).as_posix() for target, _ in writes],
                [target.relative_to(repo).as_posix() for target in deletes], title)
        prefix = "" if type_plural == "models" else f"{type_plural}/"
        commit_url = f"{prefix}{repo_id}/commit/{sha}"
        if not _OLD_CLIENT.search(self.headers.get("User-Agent", "")):
            # The name the client addressed the server by (a proxy's client knows it by
            # a name only the proxy resolves), as the Hub answers with its own host.
            host = self.headers.get("Host")
            commit_url = f"{f'http://{host}' if host else hub.url}/{commit_url}"
        # else: 0.x parses commitUrl against the endpoint frozen at its import (huggingface.co
        # unless HF_ENDPOINT was set then) and rejects any other host; the relative form
        # "<type>s/<org>/<name>/commit/<sha>" parses whatever that endpoint is.
        self._send_json(200, {
            "success": True, "commitOid": sha, "pullRequestUrl": None, "commitUrl": commit_url,
        })


def _gitignored(repo: Path, path: str) -> bool:
    """Whether the repo's ``.gitignore`` (at its root) matches ``path``: git's rules for
    the common patterns (``#`` comments, ``!`` negation, a pattern without ``/`` matches a
    name at any depth, a leading ``/`` anchors, a trailing ``/`` matches a folder)."""
    try:
        lines = (repo / ".gitignore").read_text().splitlines()
    except OSError:
        return False
    parts = path.strip("/").split("/")
    ignored = False
    for line in lines:
        pattern = line.rstrip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        folder_only = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        anchored = "/" in pattern
        pattern = pattern.lstrip("/")
        if anchored:
            # the pattern, or a folder it names, against the path from the root
            hit = any(fnmatch.fnmatchcase("/".join(parts[:n]), pattern)
                      for n in range(1, len(parts) + (0 if folder_only else 1)))
        else:
            names = parts[:-1] if folder_only else parts
            hit = any(fnmatch.fnmatchcase(name, pattern) for name in names)
        if hit:
            ignored = not negate
    return ignored


def _true(query: dict[str, list[str]], name: str) -> bool:
    """Whether the query (or form) says ``name=true`` (``True`` from 0.x, ``1``)."""
    return query.get(name, ["false"])[0].lower() in ("1", "true")


def _prune(repo: Path, folder: Path) -> None:
    """Remove ``folder`` and the folders above it (up to ``repo``) while they are empty."""
    while folder != repo and repo in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone)
            return
        folder = folder.parent


def _singular(type_plural: str) -> RepoType:
    if type_plural == "datasets":
        return "dataset"
    if type_plural == "spaces":
        return "space"
    return "model"


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    match = _RANGE.match(header.strip())
    if match is None or (not match[1] and not match[2]):
        return None
    if not match[1]:  # suffix: the last N bytes
        start, end = max(0, size - int(match[2])), size - 1
    else:
        start = int(match[1])
        end = min(int(match[2]), size - 1) if match[2] else size - 1
    if start >= size or end < start:
        return None
    return start, end


def main(argv: list[str] | None = None) -> None:
    """Serve ROOT until stdin closes or SIGTERM: ``python -m fsm.testing.hubserver ROOT``.

    (Or ``python -c "from fsm.testing.hubserver import main; main()" ROOT``, which avoids
    runpy's warning about the module being imported by ``fsm.testing`` first.)

    ``--commit-quota N``, ``--request-quota N`` and ``--quota-window S`` set the quotas
    (:meth:`LocalHubServer.set_quota`; unlimited by default, a 300 s window).
    ``--bandwidth BYTES_PER_S`` and ``--latency S`` set the network conditions
    (:meth:`LocalHubServer.set_network`; none by default).

    Prints the server's URL as the first line on stdout. Useful to run the server in a
    process of its own: hf_transfer holds the GIL while it downloads, so a client using it
    cannot share a process with this server.
    """
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser(prog="python -m fsm.testing.hubserver")
    parser.add_argument("root", type=Path, help="directory holding the repos")
    parser.add_argument("--token-env", help="name of an environment variable holding the token")
    parser.add_argument("--log", type=Path, help="append each request as a JSON line here")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--commit-quota", type=int, metavar="N",
                        help="commits admitted per quota window (default: unlimited)")
    parser.add_argument("--request-quota", type=int, metavar="N",
                        help="requests of any kind admitted per quota window (default: unlimited)")
    parser.add_argument("--quota-window", type=float, default=300.0, metavar="S",
                        help="length of the rolling quota window in seconds (default: 300)")
    parser.add_argument("--bandwidth", type=float, metavar="BYTES_PER_S",
                        help="cap each connection's response bodies at this many bytes per "
                             "second (default: unlimited)")
    parser.add_argument("--latency", type=float, default=0.0, metavar="S",
                        help="delay every answer by this many seconds (default: 0)")
    args = parser.parse_args(argv)
    try:
        quota = Quota(commits=args.commit_quota, requests=args.request_quota,
                      window_s=args.quota_window)
        network = Network(bandwidth_bps=args.bandwidth, latency_s=args.latency)
    except ValueError as err:
        parser.error(str(err))
    token = os.environ.get(args.token_env) if args.token_env else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalHubServer(args.root, token=token, port=args.port, log_file=args.log,
                        quota=quota, network=network) as server:
        print(server.url, flush=True)

        def stdin_closed() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=stdin_closed, daemon=True).start()
        stop.wait()


if __name__ == "__main__":
    main()
