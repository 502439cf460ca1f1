"""The store port: the few operations the runner needs from an artifact store.

Two adapters implement it: ``fsm.store.local.LocalStore`` (a directory that *is* the
dataset repo, selected with ``file:///dir``) and ``fsm.store.hub.HubStore`` (a Hugging
Face dataset repo through ``huggingface_hub``).

Every method is bounded in time and never runs past the store's attempt deadline.
Failures are raised as the typed errors of ``fsm.errors``:

* ``StoreUnavailable`` (retriable): connection errors, timeouts, 408/429/5xx after
  bounded retries with backoff;
* ``StoreAuthError`` (fatal): 401/403;
* ``StoreNotFound`` (fatal): a path to download does not exist;
* ``DeadlineExceeded``: the attempt deadline arrived while waiting.

``exists`` answers False for a missing path instead of raising.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

WarmOutcome = Literal["cached", "downloaded"]

#: Files a preload never warms (CONTRACT section 6).
PRELOAD_IGNORE_PATTERNS: tuple[str, ...] = (
    "*.pth",
    "*.gguf",
    "original/*",
    "*.onnx",
    "*.msgpack",
    "*.h5",
)


class Store(Protocol):
    """One dataset repo (plus the model repos a preload warms)."""

    def describe(self) -> str:
        """A short, secret-free description for logs, e.g. ``file:///srv/store``."""
        ...

    def worker_env(self) -> Mapping[str, str]:
        """What the worker's environment needs to reach the same store (``FLASH_STORE``)."""
        ...

    def upload_file(self, local_path: Path, path_in_repo: str) -> None:
        """Put ``local_path`` at ``path_in_repo``, replacing what was there."""
        ...

    def exists(self, path_in_repo: str) -> bool:
        """Whether ``path_in_repo`` is a file in the repo."""
        ...

    def download_file(self, path_in_repo: str, dest_dir: Path) -> Path:
        """Fetch one file to ``dest_dir/<path_in_repo>`` and return that path."""
        ...

    def fetch_folder(self, folder: str, local_root: Path) -> int:
        """Fetch every file under ``folder/`` to ``local_root/folder/...``; return how many."""
        ...

    def warm_model(
        self, repo_id: str, cache_dir: Path, ignore_patterns: Sequence[str]
    ) -> WarmOutcome:
        """Make model ``repo_id`` complete in the Hugging Face cache ``cache_dir``.

        Returns ``"cached"`` when it already was (probed with ``local_files_only``),
        ``"downloaded"`` otherwise. The result must be found afterwards by
        ``huggingface_hub.snapshot_download(repo_id, cache_dir=cache_dir,
        ignore_patterns=ignore_patterns, local_files_only=True)``.
        """
        ...
