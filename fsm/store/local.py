"""The local directory store: a directory that *is* the dataset repo.

Selected with ``--store file:///abs/dir`` (or ``FLASH_STORE``). Repo path ``a/b.json`` is
``dir/a/b.json``; model repo ``org/m`` (for preload) is ``dir/models/org/m/``. Writes are
atomic (write aside, then rename), so a reader never sees half a file. Warming a model
writes the standard Hugging Face cache layout, so ``huggingface_hub`` finds it offline.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from fsm.clock import Deadline
from fsm.errors import DeadlineExceeded, StoreNotFound, StoreUnavailable
from fsm.store.base import WarmOutcome

_CHUNK = 1 << 20


class LocalStore:
    def __init__(self, root: Path, *, deadline: Deadline | None = None) -> None:
        self.root = root
        self.deadline = deadline or Deadline.never()

    def describe(self) -> str:
        return self.url

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def worker_env(self) -> Mapping[str, str]:
        return {"FLASH_STORE": self.url}

    # --- the port ---------------------------------------------------------------------

    def upload_file(self, local_path: Path, path_in_repo: str) -> None:
        self._check_time()
        target = self._repo_path(path_in_repo)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic_copy(local_path, target)
        except OSError as exc:
            raise StoreUnavailable(
                f"local store: cannot write {path_in_repo}: {exc.strerror}"
            ) from exc

    def exists(self, path_in_repo: str) -> bool:
        self._check_time()
        self._root_readable()
        return self._repo_path(path_in_repo).is_file()

    def download_file(self, path_in_repo: str, dest_dir: Path) -> Path:
        self._check_time()
        self._root_readable()
        source = self._repo_path(path_in_repo)
        if not source.is_file():
            raise StoreNotFound(f"local store: {path_in_repo} not found")
        target = dest_dir / path_in_repo
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic_copy(source, target)
        return target

    def fetch_folder(self, folder: str, local_root: Path) -> int:
        self._check_time()
        self._root_readable()
        source = self._repo_path(folder)
        if not source.is_dir():
            raise StoreNotFound(f"local store: folder {folder}/ not found")
        count = 0
        for path in sorted(source.rglob("*")):
            if not path.is_dir():  # files, and anything else that reads like one
                self._check_time()
                target = local_root / folder / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                _atomic_copy(path, target)
                count += 1
        return count

    def warm_model(
        self, repo_id: str, cache_dir: Path, ignore_patterns: Sequence[str]
    ) -> WarmOutcome:
        self._check_time()
        self._root_readable()
        source = self.root / "models" / repo_id
        if not source.is_dir():
            raise StoreNotFound(f"local store: model {repo_id} not found")
        files = [
            (path.relative_to(source).as_posix(), path)
            for path in sorted(source.rglob("*"))
            if path.is_file() and not _ignored(path.relative_to(source).as_posix(), ignore_patterns)
        ]
        # The "commit" names the model's content as listed (path, size, mtime): cheap to
        # compute on every probe and different whenever the source changes.
        digest = hashlib.sha1(usedforsecurity=False)
        for rel, path in files:
            stat = path.stat()
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        commit = digest.hexdigest()
        repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / commit
        if (
            (repo_dir / "refs" / "main").is_file()
            and all((snapshot / rel).is_file() for rel, _ in files)
            and (repo_dir / "refs" / "main").read_text().strip() == commit
        ):
            return "cached"
        blobs = repo_dir / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        for rel, path in files:
            self._check_time()
            blob = blobs / _sha256(path)
            if not blob.is_file():
                _atomic_copy(path, blob)
            link = snapshot / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(blob, link.parent))
        refs = repo_dir / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        _atomic_write(refs / "main", commit.encode())
        return "downloaded"

    # --- helpers ----------------------------------------------------------------------

    def _repo_path(self, path_in_repo: str) -> Path:
        parts = path_in_repo.strip("/").split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"not a repo path: {path_in_repo!r}")
        return self.root.joinpath(*parts)

    def _root_readable(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailable(f"local store: {self.url} is not a directory")

    def _check_time(self) -> None:
        if self.deadline.expired():
            raise DeadlineExceeded("the attempt deadline passed before a store call")


def _ignored(rel: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(rel, pattern) for pattern in patterns)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_copy(source: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            shutil.copyfileobj(src, out, _CHUNK)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
