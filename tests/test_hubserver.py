"""The local Hub server speaks enough of the Hub API for the real huggingface_hub client.

These tests drive the installed client line (0.x or 1.x/2.x) against
``fsm.testing.LocalHubServer``; the fault tests use plain urllib so they measure the
server, not the client's own retries.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fsm.store.base import PRELOAD_IGNORE_PATTERNS
from fsm.store.hub import configure_transfer
from fsm.testing import LocalHubServer

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

pytestmark = pytest.mark.hub

REPO = "flash/store-test"


def _get(
    server: LocalHubServer, path: str, token: str | None, *, method: str = "GET",
    headers: dict[str, str] | None = None, timeout: float = 5.0, data: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(server.url + path, method=method, headers=headers or {},
                                     data=data)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_upload_then_file_exists_and_download(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path
) -> None:
    """upload_file lands in the repo directory; file_exists and hf_hub_download see it."""
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=hub_server.url, token=hub_token)
    api.upload_file(path_or_fileobj=b"hello", path_in_repo="run/a.txt", repo_id=hub_dataset,
                    repo_type="dataset")
    assert (hub_server.repo_dir(hub_dataset) / "run" / "a.txt").read_bytes() == b"hello"
    assert api.file_exists(hub_dataset, "run/a.txt", repo_type="dataset")
    assert not api.file_exists(hub_dataset, "run/missing.txt", repo_type="dataset")
    got = hf_hub_download(hub_dataset, "run/a.txt", repo_type="dataset", local_dir=tmp_path / "dl",
                          token=hub_token, endpoint=hub_server.url)
    assert Path(got) == tmp_path / "dl" / "run" / "a.txt"
    assert Path(got).read_bytes() == b"hello"


def test_snapshot_download_allow_patterns_into_local_dir(
    hub_server: LocalHubServer, hub_token: str, tmp_path: Path
) -> None:
    """snapshot_download of code/** fetches that folder only, into local_dir."""
    from huggingface_hub import snapshot_download

    hub_server.add_file(REPO, "code/pkg/__main__.py", "print('hi')\n")
    hub_server.add_file(REPO, "code/README", "r")
    hub_server.add_file(REPO, "sft/run1/DONE", "1")
    snapshot_download(REPO, repo_type="dataset", allow_patterns=["code/**"],
                      local_dir=tmp_path / "root", token=hub_token, endpoint=hub_server.url)
    got = sorted(p.relative_to(tmp_path / "root").as_posix()
                 for p in (tmp_path / "root").rglob("*") if p.is_file() and ".cache" not in p.parts)
    assert got == ["code/README", "code/pkg/__main__.py"]


def test_model_snapshot_found_offline_with_the_preload_ignore_patterns(
    hub_server: LocalHubServer, hub_token: str, tmp_path: Path
) -> None:
    """A model snapshot in cache_dir is found by local_files_only with the same patterns."""
    from huggingface_hub import snapshot_download

    for name in ("config.json", "model.safetensors", "tokenizer.json", "x.pth", "original/c.bin"):
        hub_server.add_file("org/tiny", name, name.encode() * 3, repo_type="model")
    patterns = list(PRELOAD_IGNORE_PATTERNS)
    online = snapshot_download("org/tiny", cache_dir=tmp_path / "hub", ignore_patterns=patterns,
                               token=hub_token, endpoint=hub_server.url)
    hub_server.stop()  # offline now: nothing may reach the server
    offline = snapshot_download("org/tiny", cache_dir=tmp_path / "hub", ignore_patterns=patterns,
                                local_files_only=True)
    assert offline == online
    names = sorted(p.relative_to(offline).as_posix() for p in Path(offline).rglob("*")
                   if p.is_file())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]


def test_ranged_get_is_answered_206_with_content_range(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """A ranged GET gets exactly those bytes, status 206 and Content-Range."""
    hub_server.add_file(hub_dataset, "blob.bin", bytes(range(256)) * 4)
    status, headers, body = _get(hub_server, f"/datasets/{hub_dataset}/resolve/main/blob.bin",
                                 hub_token, headers={"Range": "bytes=10-19"})
    assert status == 206
    assert headers["Content-Range"] == "bytes 10-19/1024"
    assert body == bytes(range(10, 20))
    assert hub_server.requests[-1].range == "bytes=10-19"


def test_head_sends_the_headers_the_client_requires(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """HEAD answers X-Repo-Commit, ETag and Content-Length; a missing file says EntryNotFound."""
    hub_server.add_file(hub_dataset, "a.txt", "abc")
    status, headers, _ = _get(hub_server, f"/datasets/{hub_dataset}/resolve/main/a.txt",
                              hub_token, method="HEAD")
    assert status == 200
    assert len(headers["X-Repo-Commit"]) == 40
    assert headers["ETag"].strip('"')
    assert headers["Content-Length"] == "3"
    status, headers, _ = _get(hub_server, f"/datasets/{hub_dataset}/resolve/main/nope",
                              hub_token, method="HEAD")
    assert (status, headers.get("X-Error-Code")) == (404, "EntryNotFound")
    status, headers, _ = _get(hub_server, "/datasets/no/such/resolve/main/a.txt", hub_token)
    assert (status, headers.get("X-Error-Code")) == (404, "RepoNotFound")


def test_wrong_token_gets_401_and_is_never_recorded(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path
) -> None:
    """The Bearer check refuses a wrong token with 401; the request log holds no token."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    hub_server.add_file(hub_dataset, "a.txt", "abc")
    with pytest.raises(HfHubHTTPError) as info:
        hf_hub_download(hub_dataset, "a.txt", repo_type="dataset", local_dir=tmp_path / "fresh",
                        token="hf_wrong_token", endpoint=hub_server.url)
    assert getattr(getattr(info.value, "response", None), "status_code", None) == 401
    assert [r.status for r in hub_server.requests] == [401]
    status, _, body = _get(hub_server, f"/datasets/{hub_dataset}/resolve/main/a.txt", None)
    assert status == 401
    assert hub_token not in repr(hub_server.requests) + body.decode()


def test_fail_answers_the_status_for_the_first_n_matching_requests(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """fail(): status S and Retry-After for the first N matches, then normal answers."""
    hub_server.add_file(hub_dataset, "a.txt", "abc")
    fault = hub_server.fail("GET", r"/resolve/main/a\.txt$", status=503, times=2, retry_after=7)
    path = f"/datasets/{hub_dataset}/resolve/main/a.txt"
    first = _get(hub_server, path, hub_token)
    assert (first[0], first[1]["Retry-After"]) == (503, "7")
    assert _get(hub_server, path, hub_token)[0] == 503
    assert _get(hub_server, path, hub_token)[2] == b"abc"
    assert _get(hub_server, path, hub_token, method="HEAD")[0] == 200  # other method: no fault
    assert fault.hits == 2
    assert [r.fault for r in hub_server.requests] == ["fail", "fail", None, None]


def test_hang_holds_a_request_for_a_bounded_time(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """hang(): the client times out; the held request is answered after the hang."""
    hub_server.add_file(hub_dataset, "a.txt", "abc")
    hub_server.hang("GET", r"/a\.txt$", seconds=0.5)
    with pytest.raises(TimeoutError):
        _get(hub_server, f"/datasets/{hub_dataset}/resolve/main/a.txt", hub_token, timeout=0.1)
    assert hub_server.wait_for(lambda log: log[0].status == 200, timeout=5)
    assert hub_server.requests[0].fault == "hang"


def test_drop_closes_the_connection_without_an_answer(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """drop(): the client sees the connection closed without a response."""
    hub_server.add_file(hub_dataset, "a.txt", "abc")
    hub_server.drop("*", r"/a\.txt$")
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError, urllib.error.URLError)):
        _get(hub_server, f"/datasets/{hub_dataset}/resolve/main/a.txt", hub_token)
    assert hub_server.wait_for(lambda log: log[0].ended_at is not None)
    assert (hub_server.requests[0].fault, hub_server.requests[0].status) == ("drop", None)
    assert _get(hub_server, f"/datasets/{hub_dataset}/resolve/main/a.txt", hub_token)[0] == 200


def test_commit_to_a_missing_repo_is_repo_not_found(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    """Like the Hub, a commit to a repo that does not exist is 404 RepoNotFound."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=hub_server.url, token=hub_token)
    with pytest.raises(HfHubHTTPError) as info:
        api.upload_file(path_or_fileobj=b"x", path_in_repo="a", repo_id="no/such",
                        repo_type="dataset")
    assert getattr(getattr(info.value, "response", None), "status_code", None) == 404


def _add(path_in_repo: str, data: bytes) -> Any:
    from huggingface_hub import CommitOperationAdd

    return CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=data)


def test_a_commit_naming_the_current_parent_lands(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """create_commit(parent_commit=<the repo's current commit>) is applied like any commit."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub_server.url, token=hub_token)
    head = api.repo_info(hub_dataset, repo_type="dataset").sha
    assert head == hub_server.commit_sha(hub_dataset)
    api.create_commit(hub_dataset, [_add("run/a.txt", b"a")], commit_message="a",
                      repo_type="dataset", parent_commit=head)
    assert (hub_server.repo_dir(hub_dataset) / "run" / "a.txt").read_bytes() == b"a"
    assert hub_server.commit_sha(hub_dataset) != head


def test_a_commit_naming_a_stale_parent_gets_412_and_writes_nothing(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """Once the repo has moved past parent_commit, the commit is refused with 412 and a JSON
    error like the Hub's; neither a new file nor a changed one is written."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=hub_server.url, token=hub_token)
    hub_server.add_file(hub_dataset, "run/kept.txt", "kept")
    stale = hub_server.commit_sha(hub_dataset)
    hub_server.add_file(hub_dataset, "run/marker.json", "{}")
    moved = hub_server.commit_sha(hub_dataset)
    with pytest.raises(HfHubHTTPError) as info:
        api.create_commit(hub_dataset, [_add("run/late.txt", b"late"),
                                        _add("run/kept.txt", b"overwritten")],
                          commit_message="late", repo_type="dataset", parent_commit=stale)
    assert getattr(getattr(info.value, "response", None), "status_code", None) == 412
    assert not (hub_server.repo_dir(hub_dataset) / "run" / "late.txt").exists()
    assert (hub_server.repo_dir(hub_dataset) / "run" / "kept.txt").read_text() == "kept"
    assert hub_server.commit_sha(hub_dataset) == moved
    commit = [r for r in hub_server.requests if "/commit/" in r.path][-1]
    assert commit.status == 412
    status, _, body = _get(hub_server, f"/api/datasets/{hub_dataset}/commit/main", hub_token,
                           method="POST", headers={"Content-Type": "application/x-ndjson"},
                           data=json.dumps({"key": "header", "value": {
                               "summary": "s", "parentCommit": stale}}).encode())
    assert status == 412
    assert "commit has happened since" in json.loads(body)["error"]


def test_the_parent_is_checked_when_a_held_commit_is_applied(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """A commit held by a hang is checked against the repo as it is when the hang ends: a
    commit that landed meanwhile makes it a 412, and the held one writes nothing."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub_server.url, token=hub_token)
    head = hub_server.commit_sha(hub_dataset)
    hub_server.hang("POST", r"/commit/", seconds=3)
    outcome: list[BaseException | None] = []

    def held() -> None:
        try:
            api.create_commit(hub_dataset, [_add("run/late.txt", b"late")], commit_message="late",
                              repo_type="dataset", parent_commit=head)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    assert hub_server.wait_for(lambda log: any(r.fault == "hang" for r in log), timeout=10)
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="run/marker.json",
                    repo_id=hub_dataset, repo_type="dataset")
    held_record = next(r for r in hub_server.requests if r.fault == "hang")
    statuses = [held_record.status]  # while held, then once answered
    thread.join(timeout=15)
    assert not thread.is_alive()
    statuses.append(held_record.status)
    assert statuses == [None, 412], "the hang must outlast the second commit"
    assert isinstance(outcome[0], Exception)
    assert getattr(getattr(outcome[0], "response", None), "status_code", None) == 412
    assert not (hub_server.repo_dir(hub_dataset) / "run" / "late.txt").exists()
    assert (hub_server.repo_dir(hub_dataset) / "run" / "marker.json").read_bytes() == b"{}"
