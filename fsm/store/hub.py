"""The Hugging Face store: one dataset repo (plus model repos to warm) on the Hub.

One client: every call is ``huggingface_hub``'s (:mod:`fsm.hub.client`), on both
supported lines, 0.36.x (``requests``, optional ``hf_transfer``) and 2.x (``httpx2``,
``hf_xet``), so the library's handling of the Hub (its redirects, proxies, certificate
store, rate-limit headers) is the adapter's. The calls are made in the agent process
(:mod:`fsm.hub.agent`), forked at the runner's first instruction (``fsm.hub.spawn``),
which sets the fast-transfer switch in its environment and imports the library beside
the runner's start; this process never imports it. Failures come back classified
(:func:`fsm.hub.library.classify`).

Every call is bounded. Each runs in a daemon thread and is waited for with a bound
(``call_timeout_s`` for metadata and small uploads, ``transfer_timeout_s`` for downloads),
never past the attempt deadline (the library has no timeout on several requests), and a
signal that stops the budget ends the wait at once. A call still running after its bound
is abandoned (the daemon thread cannot keep the interpreter alive) and counts as a
timeout. The tries, their waits and the store's requested wait (``Retry-After``, or an
exhausted ``RateLimit`` window's reset) are this adapter's; where the library retries
inside a call (2.x: listings, preupload, 429s), the bound still covers the whole call.

Failures are classified by walking the exception's cause chain (the transport exception
types differ between the hub lines):

* connection errors, timeouts, HTTP 408/409/425/429/5xx: retried with exponential backoff and
  jitter (``Retry-After`` honoured), then :class:`~fsm.errors.StoreUnavailable`;
* HTTP 401/403: :class:`~fsm.errors.StoreAuthError` at once;
* HTTP 404: ``False`` from :meth:`HubStore.exists`, :class:`~fsm.errors.StoreNotFound`
  elsewhere;
* the attempt deadline running out: :class:`~fsm.errors.DeadlineExceeded`.

Commits (:meth:`HubStore.commit`) put several files in one commit. A fenced
(optional) commit is made conditional on the repo's head: it reads the head commit, checks
the fence, and sends the head as the commit's parent; the Hub answers 412 when the branch has
moved by the time the commit is applied, so once the marker has landed a late optional
commit (one abandoned after a timeout included) is rejected server-side and writes
nothing. On 412 the head is read again and the commit tried once more, then given up
(:class:`~fsm.errors.StoreUnavailable`). A commit's deletions ride in the same commit; the
client (in the agent, one call) leaves out the ones the Hub answers are missing.

The store's own clock (the lease's, CONTRACT section 10): :meth:`HubStore.changes` is one
expanded listing of a folder (each file's last commit and its date), and
:meth:`HubStore.head_time` the repo's ``lastModified`` alone (never its file list).

The hub's settings (``HF_HUB_*``, ``HF_XET_*``) are taken from the environment the adapter
was given (the runner's merged with the payload's ``env``): before ``huggingface_hub`` is
first imported (in the agent) they are put into its environment; after it they are set
in its frozen ``constants`` where it keeps them under their own
names, and any other one is logged by name. ``HF_HUB_OFFLINE`` is never obeyed by these
calls: it is the worker's setting (the store is what the runner must reach).

The token is passed explicitly on every call (never read from the ambient environment or
a saved login) and never appears in a log event or in the text of an error raised here:
those messages are built from the operation, the repo path, the HTTP status and the
exception's type name only.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import structlog

from fsm.budget import Budget, GaveUp, backoff
from fsm.clock import Deadline
from fsm.errors import (
    DeadlineExceeded,
    Interrupted,
    StoreAuthError,
    StoreNotFound,
    StoreRefused,
    StoreUnavailable,
)
from fsm.hub import agent as hub_agent
from fsm.hub import library
from fsm.hub.library import Failure, classify
from fsm.interrupt import InterruptFlag
from fsm.output.log import Progress
from fsm.prefetch import Background
from fsm.store._hf_cache import ModelCache
from fsm.store.base import Fence, StoreStats, WarmOutcome, removals

__all__ = ["DEFAULT_ENDPOINT", "HubStore", "configure_transfer"]

log = structlog.get_logger("fsm.store.hub")

DEFAULT_ENDPOINT = "https://huggingface.co"
_T = TypeVar("_T")
_RAISE = object()  # _call's absent: a missing path raises StoreNotFound
_SMALL_UPLOAD = 8 << 20  # uploads up to this size are bounded by call_timeout_s
FETCH_WORKERS = 8  # files of a folder downloaded at once (snapshot_download's default)
_AGENT_STARTS = 2  # agent processes started for one call before the store is unavailable
#: The least time an agent is given to load the library before it counts as silent.
_LOAD_BOUND_S = 30.0
#: How long an agent has to answer a ping (from its reading loop, not a call's thread)
#: after a call went unanswered in its bound, before it counts as silent.
_PING_S = 1.0
_PING_MIN_S = 0.2  # where less than _PING_S is left of the budget

#: Whether configure_transfer set the switch in this process's own environment (a test's
#: or an embedding program's choice, which its agent inherits as it is).
_process_configured = False
_frozen_lock = threading.Lock()


# --- fast transfer -------------------------------------------------------------------------


def configure_transfer(environ: MutableMapping[str, str], *, accelerate: bool = True) -> str:
    """Switch the fast-transfer accelerator on in ``environ``; return its name.

    Called on ``os.environ`` (before ``huggingface_hub`` is imported: the hub freezes its
    settings then), it decides for every agent process this one starts
    (``fsm.hub.agent``, which inherits the environment); if nobody called it, each
    agent sets the switch in its own environment by these rules. The hub line is
    detected from the installed distribution's metadata, without importing it:

    * 0.x with ``hf_transfer`` installed: ``HF_HUB_ENABLE_HF_TRANSFER=1`` → ``"hf_transfer"``
      (parallel ranged GETs for files over 50 MiB);
    * 1.x/2.x with ``hf_xet`` (and Xet not disabled): ``HF_XET_HIGH_PERFORMANCE=1`` →
      ``"hf_xet"`` (1.x/2.x ignore ``HF_HUB_ENABLE_HF_TRANSFER``);
    * otherwise, or with ``accelerate=False`` (the switch is then set off): ``"none"``.

    Telemetry is always disabled (``HF_HUB_DISABLE_TELEMETRY=1``).
    """
    global _process_configured
    accelerator, frozen = library.switch_transfer(environ, accelerate=accelerate)
    if environ is os.environ:
        _process_configured = True
    log.info(
        "store.transfer_accelerator",
        accelerator=accelerator,
        hub_major=library.hub_major(),
        configured_after_import=frozen,
    )
    return accelerator


def _hub_settings(environ: Mapping[str, str] | None) -> dict[str, str]:
    """The settings of ``environ`` the agent applies (``fsm.hub.library.apply_settings``,
    which drops what its hub line does not read): the hub's own, and how a process reaches
    the network (proxies, CA bundles: ``library.TRANSPORT_SETTINGS``). The rest, secrets
    included, is not ours; telemetry stays ``configure_transfer``'s, and progress bars stay
    off in the runner, whose stderr is JSON lines (``fsm.output.log.quiet_libraries``)."""
    return {
        key: value
        for key, value in (environ or {}).items()
        if key in library.TRANSPORT_SETTINGS or (
            key.startswith(("HF_HUB_", "HF_XET_"))
            # HF_HUB_OFFLINE is the worker's: the runner's own calls must reach the store.
            and key not in ("HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS",
                            "HF_HUB_OFFLINE"))
    }


_frozen_reported: set[str] = set()


def _report_frozen(late: Collection[str]) -> None:
    """Log (once per name) the settings the library could not be told any more."""
    with _frozen_lock:
        fresh = sorted(set(late) - _frozen_reported)
        _frozen_reported.update(fresh)
    if fresh:
        log.warning("store.settings_frozen", ignored=fresh,
                    why="huggingface_hub was imported before these settings were known")


def _new_agent() -> hub_agent.Agent:
    """This process's agent, started now (in its environment, setting the switch itself
    or keeping the one configure_transfer set) if there is none or it is gone; the one
    before it, gone, is logged."""
    gone = hub_agent.current()
    if gone is not None and not gone.alive and not gone.killed:  # a kill is logged as such
        log.warning("hub.agent_exited", pid=gone.pid, status=gone.returncode,
                    stderr_tail=list(gone.tail), why="a new one makes the store's calls")
    # The switch is the agent's to set, unless this process's environment was configured
    # already (then it is the agent's as it is).
    return hub_agent.start(switch=not _process_configured)


# --- failure classification ----------------------------------------------------------------

def token_problem(token: str | None) -> str | None:
    """Why ``token`` cannot be sent as a header value, or None. A Hub token is printable
    ASCII without spaces; a line break (a token read from a file with its newline), a space,
    a control or non-ASCII character makes every request fail before it is sent, or sends
    another header than the one meant."""
    char = next((c for c in token or "" if not "\x21" <= c <= "\x7e"), None)
    if char is None:
        return None
    what = ("a line break" if char in "\r\n" else "a space or a tab" if char in " \t"
            else "a non-ASCII character" if ord(char) > 0x7e else "a control character")
    return (f"the token (HF_TOKEN) holds {what}, which an HTTP header cannot carry: "
            "the token is unusable as given; give HF_TOKEN the token alone")


def _refusal_fix(status: int | None, repo_id: str) -> str:
    """What to change after a refusal for good, in one line."""
    if status == 431:
        return ("the store refuses the request's headers as too large (HTTP 431): HF_TOKEN "
                "holds something other than a token; give it the token alone")
    return (f"the store refuses the request for good (HTTP {status}): check hf_repo "
            f"({repo_id}), hf_prefix and HF_TOKEN")


# --- bounded calls -------------------------------------------------------------------------


def retry_delay(
    budget: Budget, attempt: int, failure: Failure, *, base_s: float, max_s: float
) -> float | None:
    """The wait before the try after try ``attempt`` failed with ``failure`` (None: no
    other try). ``Retry-After`` when the store names it (and it is not past ``max_s``);
    after a try that got no answer in a split budget none at all (it waited its share:
    a fresh connection at once); otherwise backoff, as the budget allows it."""
    asked = failure.retry_after
    if asked is not None:
        return asked if asked <= max_s else None
    if failure.hung and budget.split > 1:
        return 0.0
    return budget.capped_backoff(backoff(attempt, base_s=base_s, max_s=max_s))



class _Transient(Exception):
    """A failure worth another try (a timeout, a connection error, 408/409/425/429/5xx)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


class _Conflict(Exception):
    """The store answered 412: the branch head is no longer the commit's parent."""


class _Sealed(Exception):
    """The fence of an optional commit was sealed before a try."""


# --- the adapter ---------------------------------------------------------------------------


class HubStore:
    """One Hugging Face dataset repo as the runner's artifact store (``fsm.store.base.Store``).

    ``token`` None means anonymous: no token is taken from the environment or a saved
    login. ``endpoint`` None means the public Hub. Retries: at most ``max_attempts`` tries
    per call, waiting ``retry_base_s * 2**n`` (jittered, at most ``retry_max_s``) or what
    ``Retry-After`` asks; a ``Retry-After`` longer than ``retry_max_s``, or a wait that
    would reach the deadline, ends the retries at once with ``StoreUnavailable``.
    """

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | None,
        deadline: Deadline,
        endpoint: str | None = None,
        call_timeout_s: float = 60.0,
        transfer_timeout_s: float = 4 * 3600.0,
        max_attempts: int = 5,
        retry_base_s: float = 1.0,
        retry_max_s: float = 30.0,
        environ: Mapping[str, str] | None = None,
        interrupt: InterruptFlag | None = None,
        stats: StoreStats | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.repo_id = repo_id
        self.endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        #: Every try and every wait between tries goes through the budget: ``budget`` when
        #: given (the end of the attempt sizes its tries), else ``deadline`` and ``interrupt``.
        self.budget = budget or Budget(deadline, interrupt)
        self.call_timeout_s = call_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.max_attempts = max_attempts
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._settings = _hub_settings(environ)
        #: Why the token cannot be sent at all (every call refuses at once), or None.
        self._token_problem = token_problem(token)
        #: Shared by the attempt's store handles: commits landed, 429s met, calls by op.
        self.stats = stats or StoreStats()
        #: The agent that makes this handle's calls, and what its client is keyed by (no
        #: token: False, so that the library never reads one from the environment).
        self._agent: hub_agent.Agent | None = None
        self._key = (self.endpoint, token or False, call_timeout_s)
        #: Whether the store has answered a call of this handle (then a 401 RepoNotFound is
        #: a mirror's word for a missing path, not a refused token).
        self._answered = False

    def __repr__(self) -> str:  # the default would show the token
        return f"HubStore({self.describe()!r})"

    # --- the port -------------------------------------------------------------------------

    def describe(self) -> str:
        return f"{self.endpoint}/datasets/{self.repo_id}"

    def worker_env(self) -> Mapping[str, str]:
        return {"HF_ENDPOINT": self.endpoint} if self.endpoint != DEFAULT_ENDPOINT else {}

    def commit(
        self, files: Mapping[str, Path], *, message: str, fence: Fence | None = None,
        optional: Collection[str] = (), delete: Collection[str] = (),
    ) -> bool:
        removed = removals(files, delete)
        if fence is not None and fence.sealed:
            return False
        if not files and not removed:
            return True  # nothing to land
        size = sum(local.stat().st_size for local in files.values())
        bound = self.call_timeout_s if size <= _SMALL_UPLOAD else self.transfer_timeout_s
        op = "upload" if len(files) == 1 else "commit"
        paths = [*files, *removed]
        label = paths[0] if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more"
        missing = f"repo {self.repo_id} not found"

        def create(parent: str | None) -> None:
            # The deletions ride in the same commit; the client leaves out the ones not
            # there (the Hub refuses a commit that deletes a missing file). It names the
            # files the repo's .gitignore made the library leave out.
            ignored = self._client().call(
                self._key, "commit", "dataset", self.repo_id, dict(files), message=message,
                parent=parent, delete=removed)
            must = sorted(set(ignored) - set(optional))
            if must:
                raise StoreRefused(
                    f"store {op} {label}: {', '.join(must)} ignored by the repo's .gitignore",
                    fix=f"the repo's .gitignore matches {', '.join(must)}: remove the "
                        "pattern that matches it from the repo's .gitignore")

        if fence is None:
            self._call(op, label, partial(create, None), bound, missing=missing)
            self.stats.count(commit=True)
            return True
        # An optional write: one try of each call, no waits between tries (its caller
        # paces it, and a 429 it meets is the caller's signal to back off).
        try:
            for _ in range(2):
                # The repo's refs only, one try (repo_info would list a fleet's whole repo).
                head = self._call("head", label, self._main_commit, self.call_timeout_s,
                                  fence=fence, missing=missing)
                # The fence is checked again after the head was read (_call, before the
                # try): a seal after that check comes before the marker, and the marker
                # moves the head away from ``head``.
                try:
                    self._call(op, label, partial(create, head), bound,
                               fence=fence, conflict=True, missing=missing)
                    self.stats.count(commit=True)
                    return True
                except _Conflict:
                    log.warning("store.commit_conflict", op=op, path=label, parent=head)
        except _Sealed:
            return False
        raise StoreUnavailable(
            f"store {op} {label}: HTTP 412 twice: the repo moved under an optional commit"
        )

    def exists(self, path_in_repo: str) -> bool:
        # A HEAD of the file (not HfApi.file_exists: it answers False to a 401).
        head = self._via("exists", "dataset", self.repo_id, path_in_repo, revision="main")
        return bool(self._call("exists", path_in_repo, head, self.call_timeout_s, absent=False))

    def list_folder(self, folder: str) -> frozenset[str]:
        folder = folder.strip("/")
        entries = self._call("list", f"{folder}/", self._via(
            "tree", "dataset", self.repo_id, folder, revision="main", recursive=False),
            self.call_timeout_s, absent=[])
        return frozenset(entry.path.rsplit("/", 1)[-1] for entry in entries)

    def changes(self, folder: str) -> dict[str, float]:
        folder = folder.strip("/")
        # One listing with each file's last commit (the Hub pages it by 50), bounded as
        # list_folder's one call is.
        listing = self._via("changes", "dataset", self.repo_id, folder, revision="main")
        dated: dict[str, float | None] = self._call("list", f"{folder}/", listing,
                                                    self.call_timeout_s, absent={})
        undated = sorted(name for name, when in dated.items() if when is None)
        if undated:  # a mirror that names no commits: the store cannot say how old they are
            raise StoreUnavailable(
                f"store list {folder}/: the store names no last commit of "
                f"{', '.join(undated[:3])}{' and more' if len(undated) > 3 else ''}")
        return {name: when for name, when in dated.items() if when is not None}

    def head_time(self, until: float | None = None) -> float | None:
        # The repo's lastModified alone (repo_info would list every file of a fleet's repo);
        # before a moment, its history newest first, stopping at the first such commit.
        modified = (self._via("last_modified", self.repo_id) if until is None else
                    self._via("last_commit_before", "dataset", self.repo_id, until,
                              revision="main"))
        when: float | None = self._call("info", self.repo_id, modified, self.call_timeout_s,
                                        absent=None)
        return when

    def list_tree(self, folder: str, limit: int) -> list[str]:
        folder = folder.strip("/")
        # Every page within one bound: the transfer's, since a big folder has many pages.
        listing = self._via("tree", "dataset", self.repo_id, folder, revision="main",
                            recursive=True, limit=limit)
        entries = self._call("list", f"{folder}/", listing, self.transfer_timeout_s, absent=[])
        start = len(folder) + 1 if folder else 0
        return sorted(entry.path[start:] for entry in entries)[: limit + 1]

    def read_file(self, path_in_repo: str, max_bytes: int) -> bytes:
        import tempfile  # the operator's commands only: not on a runner's start-up path

        # A flat name of its own in the temporary directory: no folders to make and remove.
        dest = Path(tempfile.gettempdir()) / f"flash-read-{os.getpid()}-{os.urandom(16).hex()}"
        try:
            with open(self._download(path_in_repo, dest), "rb") as file:
                return file.read(max_bytes + 1)
        finally:
            dest.unlink(missing_ok=True)

    def download_file(self, path_in_repo: str, dest_dir: Path) -> Path:
        return self._download(path_in_repo, dest_dir / path_in_repo)

    def _download(self, path_in_repo: str, dest: Path) -> Path:
        download = self._via("download", "dataset", self.repo_id, path_in_repo, dest,
                             revision="main")
        self._call("download", path_in_repo, download, self.transfer_timeout_s)
        return dest

    def fetch_folder(self, folder: str, local_root: Path) -> int:
        folder = folder.strip("/")
        label = f"{folder}/"
        # The head first, then the folder's files at that commit: the files counted are
        # the files fetched. Both answers are scoped (the refs, one folder's tree): on a
        # fleet's repo, listing every run's files would cost pages of requests.
        sha = self._call("head", label, self._main_commit, self.call_timeout_s,
                         missing=f"repo {self.repo_id} not found")
        wanted = self._call("list", label, self._via(
            "tree", "dataset", self.repo_id, folder, revision=sha, recursive=True),
            self.call_timeout_s, absent=[])
        if not wanted:
            raise StoreNotFound(f"store fetch {label}: no files under it")
        first = self._client()
        with Progress("fetch", total_files=len(wanted),
                      total_bytes=sum(entry.size for entry in wanted), folder=label) as progress:

            def fetch() -> None:
                progress.set(files=0, bytes=0)  # a retry fetches every file again
                calls = [(("dataset", self.repo_id, entry.path, local_root / entry.path),
                          {"revision": sha, "expect": entry}) for entry in wanted]
                # Before each file: a signal, or a prefetch branch cancelled, stops here.
                for size in self._client().each(self._key, "download", calls,
                                                window=FETCH_WORKERS, before=self._check_interrupt):
                    progress.advance(files=1, bytes=int(size))

            self._call("fetch", label, fetch, self.transfer_timeout_s)
        if self._client() is not first:
            # An agent taken away mid-download left its part files: not the worker's code.
            for entry in wanted:
                dest = local_root / entry.path
                for part in dest.parent.glob(f".{glob.escape(dest.name)}.*.part"):
                    part.unlink(missing_ok=True)
        return len(wanted)

    def warm_model(
        self, repo_id: str, cache_dir: Path, ignore_patterns: Sequence[str],
        on_start: Callable[[int, int], None] | None = None,  # fsm.store.base.WarmStart
    ) -> WarmOutcome:
        """The model's files at the commit ``main`` names, into the Hugging Face cache.

        Its head and tree are read first (two requests): the model is "cached" when the
        cache's ``refs/main`` names that commit and its snapshot holds every kept file.
        Otherwise each kept file is fetched by ``huggingface_hub.hf_hub_download`` into
        the cache (several at once; the accelerator, hf_transfer or hf_xet, takes the
        large ones) and checked against the listing's digest; ``refs/main`` is written
        last. When the Hub cannot be asked (it is unavailable), the cache alone decides,
        as the library's ``local_files_only`` probe does.
        """
        label = f"model {repo_id}"
        missing = f"model {repo_id} not found"
        cache = ModelCache(cache_dir, repo_id)
        try:
            commit = self._call("head", label, partial(self._main_commit, repo_id),
                                self.call_timeout_s, missing=missing)
            listed = self._call("list", label, self._via(
                "tree", "model", repo_id, "", revision=commit, recursive=True),
                self.call_timeout_s, missing=missing)
        except StoreUnavailable:
            # The library's own offline probe (snapshot_download(local_files_only=True)):
            # 1.x/2.x check the snapshot against the tree listing they cached; 0.x accept
            # any snapshot folder.
            probe = Background(self._via("cached_offline", repo_id, cache_dir,
                                         list(ignore_patterns)), "hub-cached")
            if self._wait(probe, self.call_timeout_s):
                with contextlib.suppress(Exception):
                    if probe.result():
                        return "cached"
            raise
        kept = [entry for entry in listed
                if not any(fnmatch.fnmatch(entry.path, p) for p in ignore_patterns)]
        if cache.complete(commit, (entry.path for entry in kept)):
            return "cached"
        if on_start is not None:
            on_start(len(kept), sum(entry.size for entry in kept))

        if kept:

            def fetch() -> None:
                calls = [((repo_id, entry), {"revision": commit, "cache_dir": cache_dir})
                         for entry in kept]
                for _ in self._client().each(self._key, "warm", calls, window=FETCH_WORKERS,
                                             before=self._check_interrupt):
                    pass

            self._call("warm", label, fetch, self.transfer_timeout_s)
        cache.set_main(commit)
        return "downloaded"

    # --- internals ------------------------------------------------------------------------

    def _via(self, method: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """A call of the agent's client, for :meth:`_call` to make: the agent is the one
        of the moment (a silent or exited agent's replacement, on a later try)."""
        return lambda: self._client().call(self._key, method, *args, **kwargs)

    def _client(self, bound_s: float | None = None) -> hub_agent.Agent:
        """The agent process (``fsm.hub.agent``) that makes this handle's calls (another
        once it is gone), once the library is loaded there: waited for within the budget
        (a signal ends the wait), so that no try's bound covers the import. The adapter's
        settings go to each agent first, sent without waiting for the load (the agent
        applies them before any later call), and are answered within ``bound_s`` (a try's
        bound; else the call timeout), or the agent is silent: it is taken away and
        another started."""
        if self._agent is not None and self._agent.alive:
            return self._agent
        for _ in range(_AGENT_STARTS):
            agent = _new_agent()  # the running one, or a new one
            configured: hub_agent.Pending | None = None
            with contextlib.suppress(hub_agent.AgentGone):  # then its error says why
                configured = agent.configure(self._settings)
            if not self._wait(agent.ready, max(self.call_timeout_s, _LOAD_BOUND_S),
                              "waiting for huggingface_hub to load"):
                self._silent(agent, "loading huggingface_hub")
                continue
            if agent.error is not None:
                if agent.alive:  # the library does not load here: no process will load it
                    raise ImportError(f"huggingface_hub could not be loaded: {agent.error}")
                continue
            if configured is not None and self._wait(
                    configured, self.call_timeout_s if bound_s is None else bound_s):
                break
            if configured is not None:
                self._silent(agent, "taking the store's settings")
        else:
            raise StoreUnavailable(
                f"store {self.describe()}: the huggingface_hub process exited or fell "
                f"silent {_AGENT_STARTS} times before it answered")
        _report_frozen(agent.result(configured))
        self._agent = agent
        return agent

    def _unless_answering(self, agent: hub_agent.Agent, what: str) -> None:
        """After a call went unanswered in its bound: the agent is asked whether it still
        answers at all (:meth:`~fsm.hub.agent.Agent.ping`). Yes: the call alone is slow (a
        hung connection, the library's own retries), and the next try goes to the same
        agent on a fresh connection. No: the agent is silent and is replaced."""
        try:
            bound = min(_PING_S, max(_PING_MIN_S, self.budget.remaining()))
            answered = agent.alive and self._wait(agent.ping(), bound)
        except hub_agent.AgentGone:
            return  # it exited: the next try starts another
        if not answered and agent.alive:
            self._silent(agent, what)

    def _silent(self, agent: hub_agent.Agent, what: str) -> None:
        """The agent did not answer in its bound (stopped, wedged in the kernel, or its
        interpreter held): it is killed, and the next try starts a fresh one."""
        agent.kill()
        log.warning("hub.agent_replaced", pid=agent.pid, silent_while=what,
                    why="it did not answer within the bound: a fresh one takes the call")

    def _wait(self, call: Background[_T] | threading.Event, bound: float,
              what: str | None = None) -> bool:
        """Whether ``call`` ended within ``bound``; a signal that stops the budget ends the
        wait at once (:class:`~fsm.errors.Interrupted`; the call runs on, abandoned), and
        so does the deadline while ``what`` (:class:`~fsm.errors.DeadlineExceeded`)."""
        end = time.monotonic() + bound
        while not call.wait(min(0.1, max(0.0, end - time.monotonic()))):
            self._check_interrupt()
            if what is not None and self.budget.expired():
                raise DeadlineExceeded(f"store {self.describe()}: the attempt deadline "
                                       f"passed {what}")
            if time.monotonic() >= end:
                return False
        return True

    def _check_interrupt(self) -> None:
        if self.budget.stopped():
            raise Interrupted(self.budget.interrupt.signum or 15)

    def _main_commit(self, model: str | None = None) -> str:
        """The commit ``main`` points at: the dataset's, or model ``model``'s."""
        sha: str | None = self._client().call(self._key, "main_commit",
                                              "model" if model else "dataset",
                                              model or self.repo_id)
        if sha is None:
            what = f"model {model}" if model else self.repo_id
            raise StoreUnavailable(f"store head of {what}: no main branch named")
        return sha

    def _call(
        self,
        op: str,
        path: str,
        fn: Callable[[], _T],
        bound_s: float,
        *,
        fence: Fence | None = None,
        conflict: bool = False,
        missing: str = "not found",
        absent: Any = _RAISE,
    ) -> _T:
        """``fn()`` bounded, retried and classified; a 404 is StoreNotFound(``missing``),
        or the answer ``absent`` when one is given (a missing path is no failure there).

        With ``fence`` (an optional write): one try, no waits (its caller paces it), and
        :class:`_Sealed` instead of the try once the fence is sealed. With ``conflict``:
        :class:`_Conflict` on a 412 (else a 412 is a rejection).
        """
        where = f"store {op} {path}"
        tries = self.max_attempts if fence is None else 1

        def once(attempt: int) -> _T:
            if fence is not None and fence.sealed:
                raise _Sealed(where)
            if self._token_problem is not None:  # never sent: it would fail, or worse
                raise StoreRefused(f"{where}: {self._token_problem}", fix=self._token_problem)
            # The library loaded and set up (a fresh agent, after a silent one was taken
            # away) before the try's bound starts.
            agent = self._client(self.budget.try_bound(self.call_timeout_s, attempt))
            self.stats.count(op=op)
            if self.budget.remaining() <= 0:
                raise DeadlineExceeded(f"{where}: the attempt deadline passed")
            # In a split budget (the end of the attempt) each try gets its share of what is
            # left: a hung connection is abandoned while another try still fits.
            bound = self.budget.try_bound(bound_s, attempt)
            began = time.monotonic()
            call = Background(fn, f"hub-{op}")
            if not self._wait(call, bound):  # abandoned: it runs on, a daemon
                self._unless_answering(agent, where)
                if self.budget.expired():
                    raise DeadlineExceeded(
                        f"{where}: the attempt deadline passed while waiting for the store"
                    )
                raise _Transient(Failure("retriable", f"no answer within {bound:.3g}s",
                                          hung=True))
            try:
                result = call.result()
                self._answered = True
                self.stats.answered(op, time.monotonic() - began)
                return result
            except Exception as exc:
                failure = classify(exc)
                if failure.kind == "unknown":
                    raise
            self.stats.count(throttled=failure.status == 429)
            # A mirror's answer for a path missing from a repo it has just answered for
            # (olah: 401 RepoNotFound where the Hub answers 404 EntryNotFound).
            mirror_missing = (failure.status == 401 and self._answered
                              and failure.error_code == "RepoNotFound")
            if failure.kind == "not_found" or mirror_missing:
                if absent is not _RAISE:
                    return cast(_T, absent)
                raise StoreNotFound(f"{where}: {missing}")
            if failure.kind == "auth":
                raise StoreAuthError(f"{where}: {failure.reason}: the store refused the token")
            if failure.kind == "rejected" and conflict and failure.status == 412:
                raise _Conflict(where)
            if failure.kind == "rejected":
                raise StoreRefused(f"{where}: {failure.reason}",
                                   fix=_refusal_fix(failure.status, self.repo_id))
            raise _Transient(failure)

        def delay(attempt: int, exc: Exception) -> float | None:
            if not isinstance(exc, _Transient):
                return None  # classified already: not worth another try
            wait = retry_delay(self.budget, attempt, exc.failure, base_s=self.retry_base_s,
                               max_s=self.retry_max_s)
            if wait is not None:
                log.warning("store.retry", op=op, path=path, **{"try": attempt},
                            status=exc.failure.status, error=exc.failure.reason,
                            delay_s=round(wait, 3))
            return wait

        try:
            return self.budget.retry(once, tries=tries, delay=delay, what=where)
        except GaveUp as gave_up:
            last = gave_up.last
            if not isinstance(last, _Transient):
                raise last from None
            failure = last.failure
            if gave_up.why == "refused":
                detail = f", and the store asked to wait {failure.retry_after:.3g}s"
            elif gave_up.why in ("deadline", "interrupted"):
                detail = "; no time left to retry before the attempt deadline"
            else:
                detail = f" after {tries} attempt{'s' if tries > 1 else ''}"
            raise StoreUnavailable(f"{where}: {failure.reason}{detail}", status=failure.status,
                                   retry_after=failure.retry_after) from None
