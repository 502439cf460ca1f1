"""One store contract, two adapters: LocalStore and HubStore behave the same.

Each test gets a ``Bed``: a store plus a way to seed its dataset repo and model repos
behind its back. The Hub bed runs against the local Hub server with a canary token that
must never reach a log event.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog.testing

from fsm.clock import Deadline
from fsm.errors import DeadlineExceeded, StoreNotFound
from fsm.store.base import PRELOAD_IGNORE_PATTERNS, Fence, Store
from fsm.store.hub import HubStore, configure_transfer
from fsm.testing import LocalHubServer

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

REPO = "flash/contract"


@dataclass
class Bed:
    store: Store
    put: Callable[[str, bytes], None]  # seed the dataset repo
    put_model: Callable[[str, str, bytes], None]  # seed a model repo
    make: Callable[[Deadline], Store]  # the same store with another deadline


@pytest.fixture(params=["local", pytest.param("hub", marks=pytest.mark.hub)])
def bed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bed]:
    if request.param == "local":
        from fsm.store.local import LocalStore

        root = tmp_path / "store"
        root.mkdir()

        def put(path: str, data: bytes) -> None:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)

        def put_model(repo_id: str, path: str, data: bytes) -> None:
            put(f"models/{repo_id}/{path}", data)

        def make_local(deadline: Deadline) -> Store:
            return LocalStore(root, deadline=deadline)

        yield Bed(make_local(Deadline.after(60)), put, put_model, make_local)
        return
    token = "hf_canary_contract_0123456789"
    with structlog.testing.capture_logs() as events, \
            LocalHubServer(tmp_path / "hub", token=token) as server:
        server.create_repo(REPO)

        def make_hub(deadline: Deadline) -> Store:
            return HubStore(REPO, token=token, deadline=deadline, endpoint=server.url,
                            call_timeout_s=10, retry_base_s=0.01)

        def put_hub(path: str, data: bytes) -> None:
            server.add_file(REPO, path, data)

        def put_hub_model(repo_id: str, path: str, data: bytes) -> None:
            server.add_file(repo_id, path, data, "model")

        yield Bed(make_hub(Deadline.after(60)), put_hub, put_hub_model, make_hub)
    assert token not in repr(events)


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "upload.bin"
    path.write_bytes(data)
    return path


def test_uploaded_file_exists_and_downloads_identically(bed: Bed, tmp_path: Path) -> None:
    """A one-file commit, then exists() is True and download_file returns the same bytes."""
    bed.store.commit({"sft/r1/metrics.json": _file(tmp_path, b"\x00metrics\xff")}, message="upload")
    assert bed.store.exists("sft/r1/metrics.json")
    got = bed.store.download_file("sft/r1/metrics.json", tmp_path / "dl")
    assert got == tmp_path / "dl" / "sft" / "r1" / "metrics.json"
    assert got.read_bytes() == b"\x00metrics\xff"


def test_upload_replaces_what_was_there(bed: Bed, tmp_path: Path) -> None:
    """A second upload to the same path wins."""
    bed.store.commit({"hb.json": _file(tmp_path, b"one")}, message="upload")
    bed.store.commit({"hb.json": _file(tmp_path, b"two")}, message="upload")
    assert bed.store.download_file("hb.json", tmp_path / "dl").read_bytes() == b"two"


def test_exists_is_false_for_a_missing_path(bed: Bed) -> None:
    """A missing path is an answer (False), not an error."""
    assert bed.store.exists("sft/r1/DONE") is False


def test_download_of_a_missing_path_raises_store_not_found(bed: Bed, tmp_path: Path) -> None:
    """Downloading what is not there is StoreNotFound."""
    with pytest.raises(StoreNotFound):
        bed.store.download_file("sft/r1/job_spec.json", tmp_path)


def test_fetch_folder_fetches_that_folder_only_and_counts(bed: Bed, tmp_path: Path) -> None:
    """fetch_folder puts every file under folder/ at local_root/folder/... and returns the count."""
    bed.put("code/flash/engine/worker/__main__.py", b"print('w')\n")
    bed.put("code/setup.cfg", b"[x]\n")
    bed.put("sft/r1/DONE", b"1")
    assert bed.store.fetch_folder("code", tmp_path / "root") == 2
    fetched = sorted(p.relative_to(tmp_path / "root").as_posix()
                     for p in (tmp_path / "root").rglob("*")
                     if p.is_file() and ".cache" not in p.parts)
    assert fetched == ["code/flash/engine/worker/__main__.py", "code/setup.cfg"]


def test_fetch_of_a_missing_folder_raises_store_not_found(bed: Bed, tmp_path: Path) -> None:
    """No code/ tree is StoreNotFound."""
    bed.put("sft/r1/DONE", b"1")
    with pytest.raises(StoreNotFound):
        bed.store.fetch_folder("code", tmp_path / "root")


def test_warm_model_downloads_then_reports_cached(bed: Bed, tmp_path: Path) -> None:
    """A warmed model is found offline by huggingface_hub with the preload patterns."""
    from huggingface_hub import snapshot_download

    for name in ("config.json", "model.safetensors", "tokenizer.json", "w.pth", "original/x"):
        bed.put_model("org/tiny", name, name.encode())
    cache = tmp_path / "hf_home" / "hub"
    patterns = list(PRELOAD_IGNORE_PATTERNS)
    assert bed.store.warm_model("org/tiny", cache, patterns) == "downloaded"
    assert bed.store.warm_model("org/tiny", cache, patterns) == "cached"
    snapshot = Path(snapshot_download("org/tiny", cache_dir=cache, ignore_patterns=patterns,
                                      local_files_only=True))
    assert sorted(p.name for p in snapshot.rglob("*") if p.is_file()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    assert (snapshot / "model.safetensors").read_bytes() == b"model.safetensors"


def test_warm_of_a_missing_model_raises_store_not_found(bed: Bed, tmp_path: Path) -> None:
    """A model the store does not hold is StoreNotFound."""
    with pytest.raises(StoreNotFound):
        bed.store.warm_model("org/none", tmp_path / "hub", list(PRELOAD_IGNORE_PATTERNS))


def test_no_call_runs_past_an_expired_deadline(bed: Bed, tmp_path: Path) -> None:
    """Every operation raises DeadlineExceeded once the attempt deadline has passed."""
    bed.put("a.json", b"{}")
    store = bed.make(Deadline.after(-1))
    with pytest.raises(DeadlineExceeded):
        store.exists("a.json")
    with pytest.raises(DeadlineExceeded):
        store.download_file("a.json", tmp_path)
    with pytest.raises(DeadlineExceeded):
        store.commit({"b.json": _file(tmp_path, b"x")}, message="upload")


def _files(tmp_path: Path, contents: dict[str, bytes]) -> dict[str, Path]:
    """One local file per repo path, holding its content: a mapping for commit()."""
    files: dict[str, Path] = {}
    for n, (path_in_repo, data) in enumerate(contents.items()):
        local = tmp_path / f"local-{n}"
        local.write_bytes(data)
        files[path_in_repo] = local
    return files


def test_a_commit_lands_several_files_together(bed: Bed, tmp_path: Path) -> None:
    """commit() puts every file of the mapping in the repo (replacing what was there) and
    answers True."""
    bed.put("sft/r1/console_sft.txt", b"old tail")
    files = _files(tmp_path, {"sft/r1/console_sft.txt": b"new tail",
                              "sft/r1/preload_result.json": b'{"preloaded": []}',
                              "sft/r1/lambda_attempt0.json": b'{"ok": true}'})
    assert bed.store.commit(files, message="end of attempt") is True
    for path_in_repo, local in files.items():
        got = bed.store.download_file(path_in_repo, tmp_path / "dl")
        assert got.read_bytes() == local.read_bytes()


def test_an_open_fence_lets_an_optional_commit_land(bed: Bed, tmp_path: Path) -> None:
    """A fenced commit before seal() is an ordinary write: it lands, True."""
    files = _files(tmp_path, {"run/console": b"tail"})
    assert bed.store.commit(files, message="console", fence=Fence()) is True
    assert bed.store.download_file("run/console", tmp_path / "dl").read_bytes() == b"tail"


def test_a_fenced_commit_after_seal_writes_nothing(bed: Bed, tmp_path: Path) -> None:
    """Once the fence is sealed an optional commit answers False and changes nothing: a
    new path stays absent, an existing one keeps its content."""
    bed.put("run/console", b"before the marker")
    fence = Fence()
    fence.seal()
    assert fence.sealed
    files = _files(tmp_path, {"run/console": b"late tail", "run/late": b"late"})
    assert bed.store.commit(files, message="late console", fence=fence) is False
    assert bed.store.exists("run/late") is False
    assert bed.store.download_file("run/console", tmp_path / "dl").read_bytes() == (
        b"before the marker")
