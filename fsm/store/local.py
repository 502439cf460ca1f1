"""The local directory store: a directory that *is* the dataset repo.

Selected with ``--store file:///abs/dir`` (or ``FLASH_STORE``). Repo path ``a/b.json`` is
``dir/a/b.json``; model repo ``org/m`` (for preload) is ``dir/models/org/m/``. Writes are
atomic (write aside, then rename), so a reader never sees half a file; a commit of several
files writes them all aside first, then renames them in the mapping's order, then removes
the files it deletes. A file's modification time is when it last changed by the store's
clock (:meth:`LocalStore.changes`, :meth:`LocalStore.head_time`). Warming a
model writes the standard Hugging Face cache layout, so ``huggingface_hub`` finds it
offline.

Reads stay inside the store's root: an entry on the way to what is read (the entry
itself, a folder above it, or anything under a fetched folder) that is a symbolic link
resolving outside the root, or a dangling link, is refused with
``FatalError(rule=rules.STORE_UNSAFE_LINK)`` naming the entry's repo path. Links that resolve
inside the root are followed; a linked folder that leads back to one of its own parents
is not walked twice.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from stat import S_ISREG

from fsm import rules
from fsm.budget import Budget
from fsm.clock import Deadline
from fsm.errors import (
    DeadlineExceeded,
    FatalError,
    Interrupted,
    StoreNotFound,
    StoreUnavailable,
)
from fsm.files import atomic_file
from fsm.interrupt import InterruptFlag
from fsm.store._hf_cache import ModelCache
from fsm.store.base import Fence, StoreStats, WarmOutcome, WarmStart, removals

_CHUNK = 1 << 20


class LocalStore:
    def __init__(
        self, root: Path, *, deadline: Deadline | None = None, stats: StoreStats | None = None,
        interrupt: InterruptFlag | None = None, budget: Budget | None = None,
    ) -> None:
        self.root = root
        self.stats = stats or StoreStats()
        #: Its deadline bounds every call; its signal (or a cancelled prefetch) stops a
        #: folder's copy before its next file, unless it outlives a signal (the end of the
        #: attempt: then it does not stop it).
        self.budget = budget or Budget(deadline or Deadline.never(), interrupt)

    def describe(self) -> str:
        return self.root.as_uri()

    def worker_env(self) -> Mapping[str, str]:
        return {"FLASH_STORE": self.describe()}

    # --- the port ---------------------------------------------------------------------

    def commit(
        self, files: Mapping[str, Path], *, message: str, fence: Fence | None = None,
        optional: Collection[str] = (), delete: Collection[str] = (),
    ) -> bool:
        removed = [(path, self._repo_path(path)) for path in removals(files, delete)]
        if fence is not None and fence.sealed:
            return False
        self._check_time()
        staged: list[tuple[str, Path, Path]] = []  # (path in repo, temp file, target)
        path_in_repo, verb = "", "write"  # what a failure names
        try:
            for path_in_repo, local_path in files.items():
                target = self._repo_path(path_in_repo)
                target.parent.mkdir(parents=True, exist_ok=True)
                staged.append((path_in_repo, _copy_aside(local_path, target), target))
            # Sealing takes the same lock: a seal() waits for the renames (and removals)
            # below, and once it has returned no optional commit gets past the check.
            with fence.lock if fence is not None else contextlib.nullcontext():
                if fence is not None and fence.sealed:
                    return False
                for path_in_repo, tmp, target in staged:  # noqa: B007  # a failure names it
                    os.replace(tmp, target)
                # Once every written file is visible: what the commit removes (a path not
                # there, or below a file, is nothing to remove).
                verb = "remove"
                for path_in_repo, target in removed:  # noqa: B007  # a failure names it
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        os.unlink(target)
            self.stats.count(op="commit", commit=True)
            return True
        except OSError as exc:
            raise StoreUnavailable(
                f"local store: cannot {verb} {path_in_repo}: {exc.strerror}") from exc
        finally:
            for _, tmp, _ in staged:  # the temp files not renamed (sealed, or a failure)
                tmp.unlink(missing_ok=True)

    def exists(self, path_in_repo: str) -> bool:
        return self._checked(path_in_repo).is_file()

    def list_folder(self, folder: str) -> frozenset[str]:
        return frozenset(self.changes(folder))

    def changes(self, folder: str) -> dict[str, float]:
        folder = folder.strip("/")
        source = self._checked(folder)
        if not source.is_dir():
            return {}
        times: dict[str, float] = {}
        with os.scandir(source) as listing:
            for entry in listing:
                if entry.is_symlink():  # checked as exists() would check it (unsafe: refused)
                    label = f"{folder}/{entry.name}" if folder else entry.name
                    _check_link(Path(entry.path), label, os.path.realpath(self.root))
                with contextlib.suppress(FileNotFoundError):  # removed since it was listed
                    if entry.is_file():
                        times[entry.name] = entry.stat().st_mtime
        return times

    def head_time(self, until: float | None = None) -> float | None:
        self._ready()
        # The newest regular file anywhere under the root (links are not followed): a
        # commit's files are renamed into place, so the last commit's are the newest. Before
        # ``until``, the newest of those not changed since (a file rewritten since has lost
        # its earlier times: the local store keeps no history).
        times: list[float] = []
        for directory, _, names in os.walk(self.root):
            self._check_time()
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # removed since it was listed
                    st = os.lstat(os.path.join(directory, name))
                    if S_ISREG(st.st_mode) and (until is None or st.st_mtime <= until):
                        times.append(st.st_mtime)
        return max(times, default=None)

    def list_tree(self, folder: str, limit: int) -> list[str]:
        folder = folder.strip("/")
        source = self._checked(folder)
        if not source.is_dir():
            return []
        # A file that is a link is listed unchecked: reading it checks it (and refuses one
        # that leaves the root), so one hostile entry does not hide the rest of the tree.
        return [rel for rel, _ in self._files(source, folder, limit=limit, check_files=False)]

    def read_file(self, path_in_repo: str, max_bytes: int) -> bytes:
        with open(self._file(path_in_repo), "rb") as file:
            return file.read(max_bytes + 1)

    def download_file(self, path_in_repo: str, dest_dir: Path) -> Path:
        source = self._file(path_in_repo)
        target = dest_dir / path_in_repo
        _atomic_copy(source, target)  # its folder made (atomic_file)
        return target

    def fetch_folder(self, folder: str, local_root: Path) -> int:
        folder = folder.strip("/")
        source = self._checked(folder)
        if not source.is_dir():
            raise StoreNotFound(f"local store: folder {folder}/ not found")
        # Every entry is checked before anything is copied: a refused tree leaves nothing.
        files = self._files(source, folder)
        for rel, path in files:
            self._step()
            _atomic_copy(path, local_root / folder / rel)  # its folder made (atomic_file)
        return len(files)

    def warm_model(
        self, repo_id: str, cache_dir: Path, ignore_patterns: Sequence[str],
        on_start: WarmStart | None = None,
    ) -> WarmOutcome:
        label = f"models/{repo_id}"
        source = self._checked(label)
        if not source.is_dir():
            raise StoreNotFound(f"local store: model {repo_id} not found")
        files = self._files(source, label, keep=lambda rel: not any(
            fnmatch.fnmatch(rel, pattern) for pattern in ignore_patterns))
        # The "commit" names the model's content as listed (path, size, mtime): cheap to
        # compute on every probe and different whenever the source changes.
        digest = hashlib.sha1(usedforsecurity=False)
        for rel, path in files:
            stat = path.stat()
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        commit = digest.hexdigest()
        cache = ModelCache(cache_dir, repo_id)
        if cache.complete(commit, (rel for rel, _ in files)):
            return "cached"
        if on_start is not None:
            on_start(len(files), sum(path.stat().st_size for _, path in files))
        for rel, path in files:
            self._step()
            with path.open("rb") as f:
                blob_id = hashlib.file_digest(f, "sha256").hexdigest()
            if not cache.blob(blob_id).is_file():
                _atomic_copy(path, cache.blob(blob_id))
            cache.link(commit, rel, blob_id)
        cache.set_main(commit)
        return "downloaded"

    # --- helpers ----------------------------------------------------------------------

    def _repo_path(self, path_in_repo: str) -> Path:
        parts = path_in_repo.strip("/").split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"not a repo path: {path_in_repo!r}")
        return self.root.joinpath(*parts)

    def _file(self, path_in_repo: str) -> Path:
        """The file ``path_in_repo``, checked (in time, links), else StoreNotFound."""
        source = self._checked(path_in_repo)
        if not source.is_file():
            raise StoreNotFound(f"local store: {path_in_repo} not found")
        return source

    def _checked(self, path_in_repo: str) -> Path:
        """The path of ``path_in_repo``, after checking the store (:meth:`_ready`) and every
        link on the way to it."""
        self._ready()
        path = self._repo_path(path_in_repo)
        real_root = os.path.realpath(self.root)
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            if current.is_symlink():
                _check_link(current, current.relative_to(self.root).as_posix(), real_root)
            elif not current.exists():
                break  # missing: the caller answers "not found"
        return path

    def _files(
        self, top: Path, label: str, keep: Callable[[str], bool] = lambda rel: True,
        *, limit: int | None = None, check_files: bool = True,
    ) -> list[tuple[str, Path]]:
        """Everything under ``top`` that is not a folder, as (path relative to it, path), sorted.

        Links are checked (:func:`_check_link`) before they are followed; a linked folder
        that leads back to one of its own parents is skipped. Files ``keep`` refuses are
        neither read nor checked. With ``limit`` the walk stops once it found one more
        than that. The store's deadline is checked at every folder. Without
        ``check_files`` a link that is not a folder is listed unchecked.
        """
        real_root = os.path.realpath(self.root)
        found: list[tuple[str, Path]] = []

        def visit(directory: Path, rel: str, parents: frozenset[str]) -> None:
            real = os.path.realpath(directory)
            if real in parents or (limit is not None and len(found) > limit):
                return  # a link back up the tree, or enough found
            self._check_time()
            with os.scandir(directory) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
            for entry in entries:
                child_rel = f"{rel}/{entry.name}" if rel else entry.name
                path = Path(entry.path)
                is_dir = entry.is_dir()
                if not is_dir and not keep(child_rel):
                    continue
                if entry.is_symlink() and (is_dir or check_files):
                    _check_link(path, f"{label}/{child_rel}", real_root)
                if is_dir:
                    visit(path, child_rel, parents | {real})
                else:  # files, and anything else that reads like one
                    found.append((child_rel, path))
                if limit is not None and len(found) > limit:
                    return

        visit(top, "", frozenset())
        return found

    def _ready(self) -> None:
        """Checked before a call: the deadline, and the root is a directory."""
        self._check_time()
        if not self.root.is_dir():
            raise StoreUnavailable(f"local store: {self.describe()} is not a directory")

    def _check_time(self) -> None:
        if self.budget.deadline.expired():
            raise DeadlineExceeded("the attempt deadline passed before a store call")

    def _step(self) -> None:
        """Before each file a call copies: the deadline, and a signal (or a cancel)."""
        self._check_time()
        if self.budget.stopped():
            raise Interrupted(self.budget.interrupt.signum or 15)


def _check_link(link: Path, label: str, real_root: str) -> None:
    """Refuse ``link`` (repo path ``label``) when it dangles or resolves outside the root."""
    target = os.path.realpath(link)
    why = ("a dangling link" if not os.path.exists(target)  # dangling, or a loop of links
           else "a link that leaves the store's root"
           if os.path.commonpath([target, real_root]) != real_root else None)
    if why is not None:
        raise FatalError(f"local store: {label} is {why}; refusing to read it",
                         rule=rules.STORE_UNSAFE_LINK)


def _copy_aside(source: Path, target: Path) -> Path:
    """Copy ``source`` to a new temp file next to ``target``; return the temp file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            shutil.copyfileobj(src, out, _CHUNK)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _atomic_copy(source: Path, target: Path) -> None:
    with atomic_file(target) as out, source.open("rb") as src:
        shutil.copyfileobj(src, out, _CHUNK)
