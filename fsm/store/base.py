"""The store port: the few operations the runner needs from an artifact store.

Two adapters implement it: ``fsm.store.local.LocalStore`` (a directory that *is* the
dataset repo, selected with ``file:///dir``) and ``fsm.store.hub.HubStore`` (a Hugging
Face dataset repo through ``huggingface_hub``).

Every method is bounded in time and never runs past the store's attempt deadline.
Failures are raised as the typed errors of ``fsm.errors``:

* ``StoreUnavailable`` (retriable): connection errors, timeouts, 408/409/425/429/5xx after
  bounded retries with backoff;
* ``StoreAuthError`` (fatal): 401/403;
* ``StoreNotFound`` (fatal): a path to download does not exist;
* ``DeadlineExceeded``: the attempt deadline arrived while waiting.

``exists`` answers False for a missing path instead of raising.

Writes go up as commits: :meth:`Store.commit` puts one or more files in the repo
together. A commit is either *must-land* (no fence: retried
and classified like every call) or *optional* (``fence=`` a :class:`Fence`): an optional
commit never lands once its fence is sealed, even one already in flight or abandoned
after a timeout. The runner seals the fence before it writes the attempt marker, so no
optional upload (a periodic console tail) lands after the marker (CONTRACT section 4).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

WarmOutcome = Literal["cached", "downloaded"]
#: Told what a warm is about to fetch, before its first byte: ``(files, bytes)`` of the
#: model's files the preload keeps (a warm that finds the model cached never calls it).
WarmStart = Callable[[int, int], None]

#: The preload's result, beside the marker in the final commit: like the marker, it must
#: land (a repo that would ignore it refuses the commit).
PRELOAD_RESULT_NAME = "preload_result.json"

#: Files a preload never warms (CONTRACT section 6).
PRELOAD_IGNORE_PATTERNS: tuple[str, ...] = (
    "*.pth", "*.gguf", "original/*", "*.onnx", "*.msgpack", "*.h5")


@dataclass(eq=False)
class Fence:
    """Closes the door on optional commits: once :meth:`seal` returns, none of them lands.

    ``lock`` is held by :meth:`seal` while it seals, and by a store while it makes an
    optional commit visible (the local store), so sealing waits for a commit that is
    landing at that moment and every commit after it sees ``sealed``. A store that cannot
    hold the lock across its write (the Hub) makes the write conditional on the repo's
    head instead: a write landed after the seal (the marker) rejects it server-side.
    """

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: Whether :meth:`seal` has been called.
    sealed: bool = False

    def seal(self) -> None:
        """Seal the fence (idempotent); waits for an optional commit landing right now."""
        with self.lock:
            self.sealed = True


def removals(files: Mapping[str, Path], delete: Collection[str]) -> list[str]:
    """The paths a commit of ``files`` removes (``delete``, each once, in order); a path
    both written and removed is a ``ValueError``."""
    both = sorted(set(files) & set(delete))
    if both:
        raise ValueError(f"a commit cannot both write and delete {', '.join(both)}")
    return list(dict.fromkeys(delete))


class StoreStats:
    """What an attempt's store handles did, counted across all of them (the marker's
    ``store`` evidence): commits landed, 429 answers met, and calls by operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.commits = 0
        self.throttled = 0
        self.calls: dict[str, int] = {}
        #: Seconds the last 5 answered commits took (their preupload and commit requests).
        self._commit_s: deque[float] = deque(maxlen=5)

    def answered(self, op: str, seconds: float) -> None:
        """A call of ``op`` answered after ``seconds``: a commit's time is kept."""
        if op in ("upload", "commit"):  # a commit's operations, as the adapters name them
            with self._lock:
                self._commit_s.append(seconds)

    def commit_s(self) -> float | None:
        """How long a commit takes at this store now: the slowest of the last few answered
        (None before any): what the marker's tries are sized by at the end."""
        with self._lock:
            return max(self._commit_s, default=None)

    def count(self, *, op: str | None = None, commit: bool = False,
              throttled: bool = False) -> None:
        with self._lock:
            if op is not None:
                self.calls[op] = self.calls.get(op, 0) + 1
            self.commits += commit
            self.throttled += throttled

    def evidence(self) -> dict[str, int]:
        with self._lock:
            return {"commits": self.commits, "throttled": self.throttled}


class Store(Protocol):
    """One dataset repo (plus the model repos a preload warms)."""

    def describe(self) -> str:
        """A short, secret-free description for logs, e.g. ``file:///srv/store``."""

    def worker_env(self) -> Mapping[str, str]:
        """What the worker's environment needs to reach the same store (``FLASH_STORE``)."""

    def commit(
        self, files: Mapping[str, Path], *, message: str, fence: Fence | None = None,
        optional: Collection[str] = (), delete: Collection[str] = (),
    ) -> bool:
        """Put every ``files[path_in_repo]`` (a local file) in the repo in one commit.

        Returns True when the commit landed. ``fence=None``: a must-land write, bounded,
        retried and classified like every call. With a fence the commit is
        optional: False, with nothing written, when the fence is sealed before it lands;
        it never lands after :meth:`Fence.seal` returned, even if it was already in flight.
        The local store makes the files visible in the mapping's order (the last entry
        lands last); the Hub makes them visible at once.

        ``optional``: paths the store may leave out when the repo ignores them (the Hub
        leaves out what the repo's ``.gitignore`` matches). Any other file it would leave
        out refuses the commit (:class:`~fsm.errors.StoreRefused`, naming ``.gitignore``):
        a marker is never dropped silently.

        ``delete``: repo paths (files) the same commit removes when they are there; one that
        is not there is no error (the rest of the commit lands). The local store removes
        them after the written files became visible (under the fence's lock, for a fenced
        commit); the Hub removes them in the same commit. A path may not be both written
        and deleted (``ValueError``). The marker's commit removes the attempt's lease so.
        """

    def exists(self, path_in_repo: str) -> bool:
        """Whether ``path_in_repo`` is a file in the repo."""

    def list_folder(self, folder: str) -> frozenset[str]:
        """The names of the files directly in ``folder/`` (not below it), in one call:
        empty when the folder does not exist."""

    def changes(self, folder: str) -> dict[str, float]:
        """The files directly in ``folder/`` (not below it), by name, each mapped to when it
        last changed by the store's own clock (seconds since the epoch): a local file's
        modification time, the date of the Hub commit that last touched it (millisecond
        precision: up to 1 ms before the commit). One listing (paginated on the Hub);
        empty when the folder does not exist. The lease's age is read so (CONTRACT
        section 10), never by a host's clock."""

    def head_time(self, until: float | None = None) -> float | None:
        """When the repo last took a commit, by the store's own clock (seconds since the
        epoch); with ``until``, its newest commit at or before that moment. On the Hub the
        repo's ``lastModified`` (without listing its files), or with ``until`` its history
        read newest first up to that commit (a bounded number of commits back); on a local
        store the newest modification time of a file under its root (at or before
        ``until``: a file rewritten since shows only its newest time). None when the store
        cannot say (a local store without files, a Hub that names no date, a history with
        no such commit within the bound)."""

    def list_tree(self, folder: str, limit: int) -> list[str]:
        """The paths of the files under ``folder/`` (at any depth), relative to it, sorted:
        one listing (paginated on the Hub), empty when the folder does not exist. It stops
        once more than ``limit`` are found, and then returns ``limit + 1`` of them."""

    def read_file(self, path_in_repo: str, max_bytes: int) -> bytes:
        """The content of one small file, at most ``max_bytes + 1`` bytes of it (so a longer
        one shows as longer), without laying it out under a directory."""

    def download_file(self, path_in_repo: str, dest_dir: Path) -> Path:
        """Fetch one file to ``dest_dir/<path_in_repo>`` and return that path."""

    def fetch_folder(self, folder: str, local_root: Path) -> int:
        """Fetch every file under ``folder/`` to ``local_root/folder/...``; return how many."""

    def warm_model(
        self, repo_id: str, cache_dir: Path, ignore_patterns: Sequence[str],
        on_start: WarmStart | None = None,
    ) -> WarmOutcome:
        """Make model ``repo_id`` complete in the Hugging Face cache ``cache_dir``.

        Returns ``"cached"`` when it already was (probed with ``local_files_only``),
        ``"downloaded"`` otherwise. The result must be found afterwards by
        ``huggingface_hub.snapshot_download(repo_id, cache_dir=cache_dir,
        ignore_patterns=ignore_patterns, local_files_only=True)``. Before downloading it
        tells ``on_start`` how many files and bytes it will fetch; the caller measures the
        progress in the cache itself (the standard layout: ``models--<org>--<name>/``).
        """
