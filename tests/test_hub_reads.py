"""The Hub adapter's calls, each one through ``huggingface_hub``, and what the adapter adds.

Every read and commit is the library's (``fsm.hub.client``); these tests check what
the adapter adds on top and what the library must still do for it: a folder fetched is
exactly the repo's tree (no library cache folder left in the code root), each download
checked against the store's digest (a corrupted transfer is retried, never kept),
redirects to a content host followed without the token, proxies from the environment,
warmed models in the library's own cache, commits with a no-op skipped, an LFS file
handed to the library's upload, and a ``.gitignore``'d file refused unless optional.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Events, make_store

from fsm.errors import FatalError, FlashError, StoreUnavailable
from fsm.store import PRELOAD_IGNORE_PATTERNS
from fsm.store.hub import FETCH_WORKERS
from fsm.testing import LocalHubServer
from fsm.testing.proxy import ForwardProxy

pytestmark = pytest.mark.hub

CODE = {
    "code/flash/__init__.py": b"",
    "code/flash/engine/__init__.py": b"",
    "code/flash/engine/worker/__init__.py": b"",
    "code/flash/engine/worker/__main__.py": b"print('hello')\n",
    "code/flash/lib/weights.bin": bytes(range(256)) * 64,
}


def _fill(server: LocalHubServer, repo: str, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        server.add_file(repo, path, data)


def _resolves(server: LocalHubServer) -> list[str]:
    return [f"{r.method} {r.path.rsplit('/', 1)[-1]}" for r in server.requests
            if "/resolve/" in r.path]


def test_a_folder_is_the_repos_tree_and_an_empty_file_costs_no_request(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """No request for an empty file (its digest is known), no library cache folder in
    the code root: the tree is exactly the repo's. The fetch reports its progress
    (``fetch.progress``), start and end, in files and bytes."""
    _fill(hub_server, hub_dataset, CODE)
    store = make_store(hub_server, hub_dataset, hub_token)
    hub_server.clear_requests()
    dest = tmp_path / "dest"
    assert store.fetch_folder("code", dest) == len(CODE)
    for path, data in CODE.items():
        assert (dest / path).read_bytes() == data
    gets = sorted(name for name in _resolves(hub_server) if name.startswith("GET"))
    assert gets == ["GET __main__.py", "GET weights.bin"]
    assert sorted(p.relative_to(dest).as_posix()
                  for p in dest.rglob("*") if p.is_file()) == sorted(CODE)
    progress = [e for e in events if e["event"] == "fetch.progress"]
    size = sum(len(data) for data in CODE.values())
    assert [(e["report"], e["files_done"], e["bytes_done"]) for e in progress] == [
        ("start", 0, 0), ("end", len(CODE), size)]
    assert (progress[-1]["files_total"], progress[-1]["bytes_total"]) == (len(CODE), size)


def test_a_folder_of_more_files_than_are_fetched_at_once_arrives_whole(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """Three times as many files as the adapter asks for at once (``FETCH_WORKERS``):
    every one arrives, with the mode a file the runner creates gets (its staging file's
    0600 would hide the tree from a worker of another user), and no staging file stays
    behind."""
    files = {f"code/flash/lib/m{i:02d}.py": f"X = {i}\n".encode() * (i + 1)
             for i in range(3 * FETCH_WORKERS)}
    _fill(hub_server, hub_dataset, files)
    store = make_store(hub_server, hub_dataset, hub_token)
    dest = tmp_path / "dest"
    assert store.fetch_folder("code", dest) == len(files)
    umask = os.umask(0)
    os.umask(umask)
    for path, data in files.items():
        assert (dest / path).read_bytes() == data
        assert (dest / path).stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) \
        == sorted(files)


def test_content_on_another_host_is_fetched_without_the_token(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """The Hub answers an LFS file with a redirect to a content host: the library follows it,
    checks the bytes against the ``X-Linked-Etag`` sha256, and never sends the token
    there (the CDN's records show no Authorization header; the Hub's always do)."""
    _fill(hub_server, hub_dataset, CODE)
    with LocalHubServer(hub_server.root) as cdn:  # same content, another origin, no token
        hub_server.redirect_content(cdn.url)
        store = make_store(hub_server, hub_dataset, hub_token)
        spec = store.download_file("code/flash/lib/weights.bin", tmp_path / "one")
        assert spec.read_bytes() == CODE["code/flash/lib/weights.bin"]
        assert store.fetch_folder("code", tmp_path / "all") == len(CODE)
        cdn_requests = list(cdn.requests)
    assert cdn_requests and not any(r.authorization for r in cdn_requests)
    assert all(r.authorization for r in hub_server.requests)
    assert (tmp_path / "all/code/flash/engine/worker/__main__.py").read_bytes() == \
        CODE["code/flash/engine/worker/__main__.py"]


def test_bytes_that_are_not_the_stores_are_retried_and_never_kept(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A content host serving other bytes than the Hub's digest names: each try is a
    retriable mismatch, the call ends in StoreUnavailable, and neither the file nor a
    partial download is left in the destination."""
    _fill(hub_server, hub_dataset, CODE)
    corrupt = tmp_path / "cdn-root"
    with LocalHubServer(corrupt) as cdn:
        cdn.create_repo(hub_dataset)
        cdn.add_file(hub_dataset, "code/flash/lib/weights.bin", b"\0" * len(
            CODE["code/flash/lib/weights.bin"]))
        hub_server.redirect_content(cdn.url)
        store = make_store(hub_server, hub_dataset, hub_token, max_attempts=2)
        dest = tmp_path / "dest"
        with pytest.raises(StoreUnavailable, match="ContentMismatch after 2 attempts"):
            store.download_file("code/flash/lib/weights.bin", dest)
    assert not any(p.is_file() for p in dest.rglob("*"))
    assert [e["error"] for e in events if e["event"] == "store.retry"] == ["ContentMismatch"]


_FETCH = """
import sys
from pathlib import Path
from fsm.clock import Deadline
from fsm.store.hub import HubStore

store = HubStore(sys.argv[2], token=sys.argv[3], deadline=Deadline.after(30),
                 endpoint=sys.argv[1], max_attempts=1)
print(store.fetch_folder("code", Path(sys.argv[4])))
"""


def test_reads_go_through_the_environments_proxy_with_its_credentials(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """``HTTP_PROXY`` (credentials in its URL) in a process's environment: every read goes
    through the proxy with ``Proxy-Authorization`` (and the Hub's token); ``NO_PROXY``
    naming the host sends them direct. (A process's own: the library reads the proxy
    settings when it makes its session.)"""
    _fill(hub_server, hub_dataset, CODE)
    proxy = ForwardProxy()
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env["HTTP_PROXY"] = proxy.url.replace("http://", "http://u%40x:p@")

    def fetch(dest: Path, **more: str) -> None:
        done = subprocess.run([sys.executable, "-c", _FETCH, hub_server.url, hub_dataset,
                               hub_token, str(dest)], env={**env, **more},
                              capture_output=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr.decode()[-2000:]

    try:
        fetch(tmp_path / "via")
        assert proxy.seen and all(seen.proxy_auth and seen.auth for seen in proxy.seen)
        assert all(seen.url.startswith(hub_server.url) for seen in proxy.seen)
        through = len(proxy.seen)
        fetch(tmp_path / "direct", NO_PROXY="127.0.0.1")
        assert len(proxy.seen) == through
    finally:
        proxy.close()


# --- warming a model: every file through the library, into its own cache ------------------

MODEL = "org/tiny-model"
MODEL_FILES = {
    "config.json": b'{"model_type": "tiny"}',
    "tokenizer.json": b'{"vocab": [1, 2, 3]}',
    "model.safetensors": bytes(range(256)) * 256,
    "original/consolidated.pth": b"never fetched",
}
KEPT = ("config.json", "model.safetensors", "tokenizer.json")


def _model(server: LocalHubServer) -> None:
    server.create_repo(MODEL, "model")
    for path, data in MODEL_FILES.items():
        server.add_file(MODEL, path, data, "model")


def _snapshot(cache: Path, **kw: Any) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(MODEL, cache_dir=str(cache),
                                  ignore_patterns=list(PRELOAD_IGNORE_PATTERNS), **kw))


def test_a_warmed_model_is_the_librarys_cache_and_an_online_snapshot_fetches_nothing(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """Every kept file comes through huggingface_hub (the accelerator's path) into its
    cache, checked against the listing: the library finds the snapshot offline, and an
    online snapshot_download of it afterwards downloads no file."""
    _model(hub_server)
    store = make_store(hub_server, hub_dataset, hub_token)
    cache = tmp_path / "cache"
    hub_server.clear_requests()
    assert store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS)) == "downloaded"
    gets = sorted(r.path.rsplit("/", 1)[-1] for r in hub_server.requests
                  if r.method == "GET" and "/resolve/" in r.path)
    assert gets == ["config.json", "model.safetensors", "tokenizer.json"]
    snapshot = _snapshot(cache, local_files_only=True)
    assert {p: (snapshot / p).read_bytes() for p in KEPT} == {p: MODEL_FILES[p] for p in KEPT}
    assert not (snapshot / "original").exists()

    hub_server.clear_requests()
    assert _snapshot(cache, token=hub_token, endpoint=hub_server.url) == snapshot
    assert not [r for r in hub_server.requests if r.method == "GET" and "/resolve/" in r.path]
    assert store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS)) == "cached"


def test_a_model_file_that_is_not_the_stores_is_never_left_in_the_cache(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """A content host serving other bytes than the listing's digest: the warm fails
    (retriable), and neither a blob nor a snapshot link of that file is left behind."""
    _model(hub_server)
    with LocalHubServer(tmp_path / "cdn-root") as cdn:
        cdn.create_repo(MODEL, "model")
        for path, data in MODEL_FILES.items():
            cdn.add_file(MODEL, path, b"\0" * len(data), "model")
        hub_server.redirect_content(cdn.url)
        store = make_store(hub_server, hub_dataset, hub_token, max_attempts=2)
        cache = tmp_path / "cache"
        with pytest.raises(StoreUnavailable, match="ContentMismatch"):
            store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS))
    folder = cache / "models--org--tiny-model"
    assert not [p for p in (folder / "blobs").glob("*") if p.is_file()]
    assert not [p for p in folder.glob("snapshots/*/*") if p.is_symlink() or p.is_file()]
    assert not (folder / "refs" / "main").exists()


def test_with_the_hub_down_a_cached_model_is_still_cached_and_a_new_one_is_not(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """The head cannot be read: the cache alone decides, as the library's offline probe
    does; a model the cache does not hold ends in StoreUnavailable (retriable)."""
    _model(hub_server)
    store = make_store(hub_server, hub_dataset, hub_token, max_attempts=2)
    cache = tmp_path / "cache"
    assert store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS)) == "downloaded"
    hub_server.fail("GET", r"/refs", status=503, times=100)
    assert store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS)) == "cached"
    with pytest.raises(StoreUnavailable):
        store.warm_model(MODEL, tmp_path / "empty", list(PRELOAD_IGNORE_PATTERNS))


def test_a_warm_stopped_half_way_leaves_no_reference_to_its_snapshot(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """refs/main is written last: a warm whose last file fails leaves the cache unfound
    by the library, and the next warm completes it."""
    _model(hub_server)
    hub_server.fail("GET", r"/resolve/.*/tokenizer\.json$", status=503, times=100)
    store = make_store(hub_server, hub_dataset, hub_token, max_attempts=2)
    cache = tmp_path / "cache"
    with pytest.raises(StoreUnavailable):
        store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS))
    assert not list(cache.glob("models--org--tiny-model/refs/main"))
    hub_server.clear_faults()
    assert store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS)) == "downloaded"
    assert (_snapshot(cache, local_files_only=True) / "tokenizer.json").read_bytes() == \
        MODEL_FILES["tokenizer.json"]


# --- commits: create_commit, and what the repo's .gitignore leaves out ----------------------


def test_a_commit_is_one_preupload_and_one_commit_and_a_repeat_commits_nothing(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """Two files land in one commit; committing the same content again asks the Hub and
    commits nothing (the library skips a no-op commit)."""
    (tmp_path / "m.json").write_text('{"ok": true}')
    (tmp_path / "c.txt").write_text("tail\n")
    store = make_store(hub_server, hub_dataset, hub_token)
    files = {"run/m.json": tmp_path / "m.json", "run/c.txt": tmp_path / "c.txt"}
    hub_server.clear_requests()
    assert store.commit(files, message="marker") is True
    assert [r.path.rsplit("/", 2)[-2] for r in hub_server.requests] == ["preupload", "commit"]
    repo = hub_server.repo_dir(hub_dataset)
    assert (repo / "run/m.json").read_text() == '{"ok": true}'
    hub_server.clear_requests()
    assert store.commit(files, message="marker again") is True
    assert not [r for r in hub_server.requests if "/commit/" in r.path]


def test_a_file_the_hub_wants_in_lfs_goes_through_the_librarys_upload(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """The Hub answers ``lfs`` for a path: the library's LFS or Xet upload, which this
    server does not implement, is what fails; nothing lands."""
    hub_server.answer_preupload(r"\.bin$", "lfs")
    (tmp_path / "w.bin").write_bytes(b"\1" * 1000)
    store = make_store(hub_server, hub_dataset, hub_token, max_attempts=1)
    with pytest.raises(FlashError):
        store.commit({"run/w.bin": tmp_path / "w.bin"}, message="weights")
    assert [r for r in hub_server.requests if "/preupload/" in r.path]
    assert not (hub_server.repo_dir(hub_dataset) / "run/w.bin").exists()


def test_a_file_the_repo_ignores_is_a_clear_refusal_unless_it_is_optional(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
) -> None:
    """The repo's ``.gitignore`` matches the marker (preupload ``shouldIgnore``): the
    library would leave it out and report a commit; the adapter refuses for good, naming
    the ``.gitignore``. A matched optional file (a console tail) is left out, and the
    rest lands."""
    hub_server.add_file(hub_dataset, ".gitignore", "*_attempt*.json\nconsole_*.txt\n")
    (tmp_path / "m.json").write_text("{}")
    (tmp_path / "c.txt").write_text("tail")
    store = make_store(hub_server, hub_dataset, hub_token)
    marker = {"run/lambda_attempt0.json": tmp_path / "m.json"}
    with pytest.raises(FatalError, match=r"ignored by the repo's \.gitignore") as refused:
        store.commit(marker, message="marker")
    assert "run/lambda_attempt0.json" in str(refused.value)
    assert len([r for r in hub_server.requests if "/preupload/" in r.path]) == 1  # no retry
    both = {"run/console_sft.txt": tmp_path / "c.txt", "run/m.json": tmp_path / "m.json"}
    assert store.commit(both, message="marker", optional=["run/console_sft.txt"]) is True
    repo = hub_server.repo_dir(hub_dataset)
    assert (repo / "run/m.json").exists() and not (repo / "run/console_sft.txt").exists()
