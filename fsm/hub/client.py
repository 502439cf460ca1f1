"""The Hub adapter's calls, each one a call of ``huggingface_hub`` (0.36.x or 2.x).

The adapter (``fsm.store.hub``) bounds, retries and classifies; this module makes each
call through the library and adds what the library does not do:

* the head commit is ``list_repo_refs`` (the repo's refs, not ``repo_info``, which lists
  every file of a fleet's repo); a folder is ``list_repo_tree(path_in_repo=...)``, never a
  listing of the whole repo;
* existence is a ``HEAD`` of the file through ``get_hf_file_metadata`` (not
  ``file_exists``: it answers False to a 401);
* a download is the library's ``http_get`` (one GET) into a part file beside its
  destination, checked against the store's own digest of the file (the git blob id of a
  regular file, the sha256 of an LFS/Xet one, and its size: from the folder's listing,
  else from the library's ``HEAD`` of it) before the file is moved where it is used. A mismatch is
  :class:`ContentMismatch`, a transport failure (retried);
* a commit is ``create_commit`` (with ``parent_commit`` for a fenced one), and afterwards
  the files the repo's ``.gitignore`` made the library leave out (preupload's
  ``shouldIgnore``) are named to the adapter, which refuses one that must land. Its deletions
  are ``CommitOperationDelete``; the Hub refuses the whole commit when one of them names a
  missing file (404 ``EntryNotFound``), so then the paths are looked up
  (``get_paths_info``) and the commit is made again without the missing ones;
* when each file of a folder last changed is one listing with ``expand=True`` (each
  file's last commit); when the repo last took a commit is its ``lastModified`` alone
  (``dataset_info(expand=["lastModified"])``: no listing of its files); the newest commit
  before a moment is read from the repo's history, newest first, stopping at it.

The library follows the Hub's redirects (a repo id in another case or an old name: ``307``
with a path-only ``Location``, POSTs included), reads its rate-limit headers, trusts the
certificate store its line trusts and speaks to proxies as its HTTP stack does. The token
is passed explicitly on every call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from fsm.files import atomic_file
from fsm.hub.library import classify

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

__all__ = ["ContentMismatch", "Entry", "HubClient"]

_EMPTY_BLOB = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's id of the empty file
#: How far back :meth:`HubClient.last_commit_before` reads a repo's history: commits, newest
#: first (the Hub pages them by 50). A fleet's repo takes at most about 128 an hour.
COMMITS_SCANNED = 500


@dataclass(frozen=True)
class Entry:
    """One file of a tree listing: what its download is checked against."""

    path: str
    size: int
    oid: str  # the git blob id (of the LFS pointer, for an LFS file)
    sha256: str | None = None  # the content's digest, for an LFS/Xet file


class ContentMismatch(ConnectionError):
    """A download whose bytes are not the store's: cut or corrupted on the way."""


class HubClient:
    """The Hub's calls at one endpoint with one token, through ``huggingface_hub``."""

    def __init__(self, endpoint: str, token: str | bool, timeout_s: float) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    @functools.cached_property
    def api(self) -> HfApi:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self._token)

    # --- reads ----------------------------------------------------------------------------

    def main_commit(self, repo_type: str, repo_id: str) -> str | None:
        """The commit ``main`` points at, or None when the repo names no ``main``."""
        refs = self.api.list_repo_refs(repo_id, repo_type=repo_type, token=self._token)
        return next((str(b.target_commit) for b in refs.branches if b.name == "main"), None)

    def tree(self, repo_type: str, repo_id: str, folder: str, *, revision: str,
             recursive: bool, limit: int | None = None) -> list[Entry]:
        """The files of ``folder`` (below it too when ``recursive``), every page (with
        ``limit``: no further page once more than that many were found; the library's
        listing is an iterator that reads a page when it needs one)."""
        files = self._files(repo_type, repo_id, folder, revision=revision, recursive=recursive,
                            expand=False)
        # The sha256 of an LFS/Xet file's content: its lfs (a BlobLfsInfo, else None).
        return [Entry(item.path, int(item.size or 0), str(item.blob_id or ""),
                      str(item.lfs.sha256) if item.lfs and item.lfs.sha256 else None)
                for item in itertools.islice(files, None if limit is None else limit + 1)]

    def changes(self, repo_type: str, repo_id: str, folder: str, *, revision: str,
                ) -> dict[str, float | None]:
        """The files directly in ``folder``, by name, each with the date of the commit that
        last touched it (seconds since the epoch; None where the listing names none, as a
        mirror may): one listing with ``expand=True``, every page (50 entries each)."""
        files = self._files(repo_type, repo_id, folder, revision=revision, recursive=False,
                            expand=True)
        return {item.path.rsplit("/", 1)[-1]: _epoch(getattr(item.last_commit, "date", None))
                for item in files}

    def _files(self, repo_type: str, repo_id: str, folder: str, *, revision: str,
               recursive: bool, expand: bool) -> Iterator[RepoFile]:
        """The files (not folders) of a listing of ``folder``, read a page at a time."""
        from huggingface_hub.hf_api import RepoFile

        items = self.api.list_repo_tree(
            repo_id, path_in_repo=folder or None, recursive=recursive, expand=expand,
            revision=revision, repo_type=repo_type, token=self._token)
        return (item for item in items if isinstance(item, RepoFile))

    def last_modified(self, repo_id: str) -> float | None:
        """When the dataset repo last took a commit (its ``lastModified``, seconds since the epoch),
        or None when the answer names no date. Only that field is asked for where the
        library asks for it (``expand``): the repo's whole info lists every file."""
        info = self.api.dataset_info(repo_id, expand=["lastModified"], token=self._token)
        return _epoch(getattr(info, "last_modified", None))

    def last_commit_before(self, repo_type: str, repo_id: str, until: float, *,
                           revision: str) -> float | None:
        """The date of the newest commit of ``revision`` at or before ``until`` (seconds
        since the epoch): its history read newest first (``GET /api/<type>s/<repo>/commits/
        <rev>``, the library's ``paginate``), stopping at the first such commit. None when
        the history has none, or the first :data:`COMMITS_SCANNED` are all later (a page is
        fetched only when needed)."""
        from huggingface_hub.utils import (  # type: ignore[attr-defined]
            build_hf_headers,
            paginate,
            parse_datetime,
        )

        url = f"{self.endpoint}/api/{repo_type}s/{repo_id}/commits/{quote(revision, safe='')}"
        items = paginate(url, params={}, headers=build_hf_headers(token=self._token))
        for item in itertools.islice(items, COMMITS_SCANNED):
            date = item.get("date") if isinstance(item, dict) else None
            with contextlib.suppress(ValueError):  # not a date: this commit says nothing
                when = _epoch(parse_datetime(date)) if isinstance(date, str) else None
                if when is not None and when <= until:
                    return when
        return None

    def exists(self, repo_type: str, repo_id: str, path: str, *, revision: str) -> bool:
        """Whether the file is there: a HEAD of it (a 404 raises, for the caller to read)."""
        self._metadata(repo_type, repo_id, path, revision)
        return True

    # --- downloads ------------------------------------------------------------------------

    def download(self, repo_type: str, repo_id: str, path: str, dest: Path, *,
                 revision: str, expect: Entry | None = None) -> int:
        """Fetch one file to ``dest``, checked; return its size.

        With ``expect`` (the file's entry in a listing, at the commit ``revision`` names),
        the library's own download (``file_download.http_get``: its session, redirects,
        proxies and in-call retries) streams the file into a part file beside ``dest``:
        one GET, where ``hf_hub_download`` would first ask for the file's metadata and
        keep a cache of blobs, links and locks the runner does not use (it lays the files
        out itself). Without one, the library's ``HEAD`` of the file says what to expect
        (:meth:`_metadata`) before the one GET. Either way the bytes are checked against
        the store's digest before they are moved to ``dest``.
        """
        if expect is None:
            expect = self._metadata(repo_type, repo_id, path, revision)
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

        # The mode a file the process creates gets (the worker's code tree is read by
        # whoever runs it); ".part", which the store clears after a killed agent.
        with atomic_file(dest, mode=0o666, suffix=".part") as file:
            if expect.size == 0 and expect.oid == _EMPTY_BLOB:  # its id is its content: no GET
                return 0
            http_get(self._url(repo_type, repo_id, path, revision), file,
                     headers=build_hf_headers(token=self._token))
            file.flush()
            return verify(Path(file.name), expect, path)

    def _metadata(self, repo_type: str, repo_id: str, path: str, revision: str) -> Entry:
        """What a file no listing named is checked against, from the library's ``HEAD``
        of it (``get_hf_file_metadata``, as ``hf_hub_download`` asks first): its size and
        its ETag (the git blob id of a regular file, the sha256 of an LFS/Xet one). Bytes
        of another version (``revision`` moved on meanwhile) do not pass the check."""
        from huggingface_hub import get_hf_file_metadata

        meta = get_hf_file_metadata(self._url(repo_type, repo_id, path, revision),
                                    token=self._token, timeout=self.timeout_s,
                                    endpoint=self.endpoint)
        etag = str(meta.etag or "").lower()
        size = meta.size if isinstance(meta.size, int) else -1
        return Entry(path, size, etag if re.fullmatch("[0-9a-f]{40}", etag) else "",
                     etag if re.fullmatch("[0-9a-f]{64}", etag) else None)

    def _url(self, repo_type: str, repo_id: str, path: str, revision: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(repo_id, path, repo_type=repo_type, revision=revision,
                          endpoint=self.endpoint)

    def warm(self, repo_id: str, entry: Entry, *, revision: str, cache_dir: Path) -> int:
        """One model file into the Hugging Face cache at ``cache_dir`` (the library's own
        layout: a blob, and a link in the commit's snapshot), checked against its listing
        entry: a blob that is not the store's is removed, with its link."""
        from huggingface_hub import hf_hub_download

        snapshot = Path(hf_hub_download(
            repo_id, entry.path, repo_type="model", revision=revision,
            cache_dir=str(cache_dir), token=self._token, endpoint=self.endpoint,
            etag_timeout=self.timeout_s))
        try:
            return verify(snapshot.resolve(), entry, entry.path)
        except ContentMismatch:
            snapshot.resolve().unlink(missing_ok=True)
            snapshot.unlink(missing_ok=True)
            raise

    def cached_offline(self, repo_id: str, cache_dir: Path, patterns: list[str]) -> bool:
        """Whether the model is complete in the cache at ``cache_dir`` by the library's own
        offline probe (``snapshot_download(local_files_only=True)``: 1.x/2.x check the
        snapshot against the tree listing they cached; 0.x accept any snapshot folder)."""
        from huggingface_hub import snapshot_download

        with contextlib.suppress(Exception):  # else not (completely) in the cache
            snapshot_download(repo_id, cache_dir=str(cache_dir), ignore_patterns=patterns,
                              token=self._token, local_files_only=True)
            return True
        return False

    # --- commits --------------------------------------------------------------------------

    def commit(self, repo_type: str, repo_id: str, files: Mapping[str, Path], *,
               message: str, parent: str | None = None,
               delete: Collection[str] = ()) -> list[str]:
        """One commit of ``files`` (path in repo -> local file) that also removes the files
        ``delete`` names, ``parent_commit=parent`` when given (the Hub answers 412 when the
        branch moved).

        The Hub refuses a commit that deletes a missing file (404 ``EntryNotFound``): then
        the paths to delete are looked up at the commit's parent (else ``main``) and the
        commit is made again without the missing ones (nothing at all when it only deleted
        missing files); when none of them is missing the refusal stands.

        The library leaves out, silently, a file the repo's ``.gitignore`` matches: the
        paths it left out are returned (the commit, if it was made, holds the others)."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        removing = list(delete)  # each once already (fsm.store.base.removals)
        while True:
            # Fresh operations for each try: the library marks them as it sends them.
            adds = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local))
                    for path, local in files.items()]
            operations: list[CommitOperationAdd | CommitOperationDelete] = [
                *adds, *(CommitOperationDelete(path_in_repo=path) for path in removing)]
            if not operations:
                return []  # it only deleted files that are not there: nothing to commit
            try:
                self.api.create_commit(
                    repo_id=repo_id, repo_type=repo_type, operations=operations,
                    commit_message=message, token=self._token, parent_commit=parent)
            except ValueError as exc:
                # 0.x parses the commit's URL against the endpoint frozen at its import (the
                # Hub's, unless HF_ENDPOINT named this one then), after the commit was made
                # or found a no-op: the commit stands.
                if "Unable to retrieve user and repo ID" not in str(exc):
                    raise
            except Exception as exc:
                # The Hub's 404 EntryNotFound: the answer to deleting a file not there.
                if not removing or classify(exc).error_code != "EntryNotFound":
                    raise
                # Which of them are there: one request (the Hub leaves out the others).
                found = self.api.get_paths_info(repo_id, removing, revision=parent or "main",
                                                  repo_type=repo_type, token=self._token)
                present = {item.path for item in found} & set(removing)
                if len(present) == len(removing):  # not about a deletion: it stands
                    raise
                removing = [path for path in removing if path in present]
                continue
            return [op.path_in_repo for op in adds if getattr(op, "_should_ignore", False)]



def _epoch(date: object) -> float | None:
    """A date of the Hub's answer as seconds since the epoch, or None when it is not a
    date. The library parses every date as UTC (``parse_datetime``: an aware datetime, on
    both lines)."""
    return date.timestamp() if isinstance(date, datetime) else None


def verify(local: Path, expect: Entry, path: str) -> int:
    """``local``'s size, once its bytes are checked against ``expect``: its size, and its
    sha256 (an LFS/Xet file) or else its git blob id (when the store named one)."""
    size = local.stat().st_size
    if expect.size >= 0 and size != expect.size:
        raise ContentMismatch(f"{path}: {size} bytes arrived, the store has {expect.size}")
    if expect.sha256 is not None:
        want, digest = expect.sha256, hashlib.sha256()
    elif expect.oid:
        want = expect.oid
        digest = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    else:
        return size
    with local.open("rb") as f:
        if hashlib.file_digest(f, lambda: digest).hexdigest() != want.lower():
            raise ContentMismatch(f"{path}: the bytes that arrived are not the store's")
    return size

