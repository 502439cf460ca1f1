"""The Hugging Face cache layout, as the stores write it when they warm a model.

``huggingface_hub`` keeps a repo under ``<cache>/models--<org>--<name>/``::

    blobs/<blob id>                      the content, once (git blob id, or LFS sha256)
    snapshots/<commit>/<path>            relative symlinks into blobs/
    refs/main                            the commit ``main`` named when it was fetched

and ``snapshot_download(..., local_files_only=True)`` finds a warmed model by
``refs/main`` and the snapshot's files. A blob is named by the id the Hub sends as the
file's ETag, so a later online ``snapshot_download`` of the same commit finds every blob
already there and downloads nothing.

Writes are atomic (a temporary name, then a rename), and ``refs/main`` is written last: a
warm stopped half-way leaves no reference to an incomplete snapshot.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from fsm.files import write_atomic

__all__ = ["ModelCache"]


class ModelCache:
    """One model repo's folder in a Hugging Face cache directory."""

    def __init__(self, cache_dir: Path, repo_id: str) -> None:
        self.folder = cache_dir / ("models--" + repo_id.replace("/", "--"))

    def complete(self, commit: str, paths: Iterable[str]) -> bool:
        """Whether ``refs/main`` names ``commit`` and its snapshot has every file in
        ``paths`` (links followed: a link to a missing blob does not count)."""
        with contextlib.suppress(OSError):
            if (self.folder / "refs" / "main").read_text().strip() == commit:
                snapshot = self.folder / "snapshots" / commit
                return all((snapshot / path).is_file() for path in paths)
        return False

    def blob(self, blob_id: str) -> Path:
        """Where blob ``blob_id`` lives (an atomic write there makes its folder)."""
        return self.folder / "blobs" / blob_id

    def link(self, commit: str, path: str, blob_id: str) -> None:
        """``snapshots/<commit>/<path>`` as a relative link to the blob (replaced if there)."""
        link = self.folder / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.blob(blob_id), link.parent)
        temp = link.with_name(f".{link.name}.{os.getpid()}.link")
        temp.unlink(missing_ok=True)
        temp.symlink_to(target)
        os.replace(temp, link)

    def set_main(self, commit: str) -> None:
        """``refs/main`` names ``commit``: the last write of a warm."""
        write_atomic(self.folder / "refs" / "main", commit)
