"""Quota emulation in the local Hub server: commit and request quotas over a rolling window.

Driven with the real huggingface_hub client (HfApi against ``hub_server.url``); a few checks
use plain urllib, to see the server's answer without the client's own handling. The
client never retries a refused commit (``create_commit``) nor a metadata HEAD, so these
tests see each 429 at once.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import pytest

from fsm.store.hub import configure_transfer
from fsm.testing import LocalHubServer, RequestRecord
from fsm.testing.hubserver import Quota, main, request_kind

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

pytestmark = pytest.mark.hub

COMMIT_429 = ("You have exceeded our hourly quotas for action: commit. "
              "We invite you to retry later.")


def _api(hub: LocalHubServer, token: str) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=token)


def _commit(api: Any, repo: str, path: str, data: bytes = b"x") -> Any:
    from huggingface_hub import CommitOperationAdd

    return api.create_commit(repo, [CommitOperationAdd(path_in_repo=path, path_or_fileobj=data)],
                             commit_message=path, repo_type="dataset")


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


class _Served(Protocol):
    @property
    def url(self) -> str: ...


def _http(
    hub: _Served, path: str, token: str | None, *, method: str = "GET",
    data: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(hub.url + path, method=method, data=data)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _by_path(records: list[RequestRecord]) -> Counter[str]:
    """The kinds, classified here from method and path independently of the server."""
    tally: Counter[str] = Counter()
    for r in records:
        if r.method == "POST" and "/commit/" in r.path:
            tally["commit"] += 1
        elif r.path.startswith("/api/"):
            tally["api"] += 1
        elif "/resolve/" in r.path and r.method in ("GET", "HEAD"):
            tally["resolver"] += 1
        else:
            tally["other"] += 1
    return tally


def test_unlimited_by_default(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """No quota unless asked: many commits and reads pass, nothing is throttled."""
    assert hub_server.quota == Quota() and hub_server.quota.unlimited
    api = _api(hub_server, hub_token)
    for i in range(12):
        _commit(api, hub_dataset, f"run/{i}.txt")
        assert api.file_exists(hub_dataset, f"run/{i}.txt", repo_type="dataset")
    assert {r.status for r in hub_server.requests} == {200}
    # create_commit asks preupload (api) first, then commits.
    assert hub_server.counts() == {"api": 12, "resolver": 12, "commit": 12, "other": 0,
                                   "throttled": 0}
    assert all(r.throttled is None for r in hub_server.requests)


def test_commit_quota_answers_429_with_retry_after_and_the_hubs_words(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """Past the commit quota, commits get 429 + Retry-After, write nothing and count against
    nothing; reads are not limited by the commit quota."""
    from huggingface_hub.errors import HfHubHTTPError

    quota = hub_server.set_quota(commits=2, window_s=60)
    assert quota == Quota(commits=2, window_s=60) == hub_server.quota
    api = _api(hub_server, hub_token)
    _commit(api, hub_dataset, "run/a.txt")
    _commit(api, hub_dataset, "run/b.txt")
    head = hub_server.commit_sha(hub_dataset)
    with pytest.raises(HfHubHTTPError) as info:
        _commit(api, hub_dataset, "run/c.txt")
    assert _status(info.value) == 429
    response = info.value.response
    retry_after = response.headers["Retry-After"]
    assert retry_after.isdigit() and 58 <= int(retry_after) <= 60
    assert response.json() == {"error": COMMIT_429}
    assert COMMIT_429 in str(info.value)
    assert not (hub_server.repo_dir(hub_dataset) / "run" / "c.txt").exists()
    assert hub_server.commit_sha(hub_dataset) == head
    # The same through plain HTTP: an NDJSON commit is refused before it is read.
    status, headers, body = _http(hub_server, f"/api/datasets/{hub_dataset}/commit/main",
                                  hub_token, method="POST", data=b"")
    assert (status, json.loads(body)) == (429, {"error": COMMIT_429})
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert "RateLimit" not in headers  # the commit quota's answer carries none
    # The commit quota leaves reads alone.
    assert api.file_exists(hub_dataset, "run/a.txt", repo_type="dataset")
    assert hub_server.counts() == {"api": 3, "resolver": 1, "commit": 4, "other": 0,
                                   "throttled": 2}
    assert [r.throttled for r in hub_server.requests if r.kind == "commit"] == [
        None, None, "commits", "commits"]


def test_commits_are_admitted_again_once_the_window_has_passed(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """Rolling window: a commit frees its place window_s after it was admitted; the
    throttled attempts meanwhile do not hold the window open."""
    from huggingface_hub.errors import HfHubHTTPError

    window = 1.0
    hub_server.set_quota(commits=1, window_s=window)
    api = _api(hub_server, hub_token)
    _commit(api, hub_dataset, "run/first.txt")
    admitted = next(r for r in hub_server.requests if r.kind == "commit").at
    refusals: list[str] = []
    deadline = time.monotonic() + 5
    while True:
        refused: HfHubHTTPError | None = None
        try:
            _commit(api, hub_dataset, "run/second.txt")
        except HfHubHTTPError as exc:
            refused = exc
        if refused is None:
            break
        assert _status(refused) == 429
        refusals.append(refused.response.headers["Retry-After"])
        assert time.monotonic() < deadline, "the window never passed"
        time.sleep(0.05)
    second = [r for r in hub_server.requests if r.kind == "commit"][-1]
    assert second.status == 200
    # Records are stamped on arrival, a little before admission: allow for that.
    assert window - 0.05 <= second.at - admitted < window + 0.5
    assert refusals and set(refusals) == {"1"}  # ceil of less than a second, at least 1
    assert (hub_server.repo_dir(hub_dataset) / "run" / "second.txt").read_bytes() == b"x"
    assert hub_server.counts()["throttled"] == len(refusals)


def test_retry_after_is_the_ceiling_of_the_wait_for_the_oldest_counted_commit(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """Retry-After counts from the oldest commit in the window; a quota of 0 refuses all."""
    hub_server.set_quota(commits=2, window_s=4)
    path = f"/api/datasets/{hub_dataset}/commit/main"
    assert _http(hub_server, path, hub_token, method="POST", data=b"")[0] == 200
    time.sleep(1.2)
    assert _http(hub_server, path, hub_token, method="POST", data=b"")[0] == 200
    status, headers, _ = _http(hub_server, path, hub_token, method="POST", data=b"")
    first = next(r for r in hub_server.requests if r.kind == "commit")
    expected = math.ceil(first.at + 4 - hub_server.requests[-1].at)
    assert status == 429
    assert int(headers["Retry-After"]) in (expected, expected + 1)  # rounding at the edge
    assert int(headers["Retry-After"]) <= 3  # the oldest, not the newest (which says 4)
    hub_server.set_quota(commits=0, window_s=3)
    status, headers, _ = _http(hub_server, path, hub_token, method="POST", data=b"")
    assert (status, headers["Retry-After"]) == (429, "3")


def test_the_request_quota_throttles_reads_of_every_kind(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """The request quota counts every request: reads through the API and the resolver
    are refused once it is used up, with the Hub's RateLimit headers; so are commits."""
    from huggingface_hub.errors import HfHubHTTPError

    hub_server.add_file(hub_dataset, "a.txt", "abc")
    hub_server.set_quota(requests=4, window_s=60)
    api = _api(hub_server, hub_token)
    assert api.repo_info(hub_dataset, repo_type="dataset").sha
    assert api.file_exists(hub_dataset, "a.txt", repo_type="dataset")
    _commit(api, hub_dataset, "b.txt")  # preupload and commit: two requests
    with pytest.raises(HfHubHTTPError) as head:
        api.file_exists(hub_dataset, "a.txt", repo_type="dataset")
    assert _status(head.value) == 429
    assert head.value.response.headers["RateLimit"].startswith('"resolvers";r=0;t=')
    with pytest.raises(HfHubHTTPError) as info:
        api.repo_info(hub_dataset, repo_type="dataset")
    response = info.value.response
    assert _status(info.value) == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    assert response.headers["RateLimit"] == f'"api";r=0;t={response.headers["Retry-After"]}'
    assert response.headers["RateLimit-Policy"] == '"rolling window";"api";q=4;w=60'
    assert "rate limit" in response.json()["error"]
    # (Plain HTTP here: the client retries a refused preupload after Retry-After.)
    status, _, body = _http(hub_server, f"/api/datasets/{hub_dataset}/commit/main", hub_token,
                            method="POST", data=b"")
    assert status == 429 and "rate limit" in json.loads(body)["error"]
    assert [r.throttled for r in hub_server.requests] == [None] * 4 + ["requests"] * 3
    assert hub_server.counts() == {"api": 3, "resolver": 2, "commit": 2, "other": 0,
                                   "throttled": 3}


def test_counts_by_kind_match_the_requests_made(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path
) -> None:
    """counts() tallies the log by kind (answer whatever), like a classification by path;
    RequestRecord.kind says each request's kind; clear_requests() resets the tallies."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    hub_server.set_quota(commits=2, window_s=60)
    api = _api(hub_server, hub_token)
    api.upload_file(path_or_fileobj=b"1", path_in_repo="run/1.txt", repo_id=hub_dataset,
                    repo_type="dataset")  # preupload (api) + commit
    _commit(api, hub_dataset, "run/2.txt")
    with pytest.raises(HfHubHTTPError) as info:
        _commit(api, hub_dataset, "run/3.txt")  # preupload, then the commit gets 429
    assert _status(info.value) == 429
    hf_hub_download(hub_dataset, "run/1.txt", repo_type="dataset", token=hub_token,
                    endpoint=hub_server.url, local_dir=tmp_path / "dl")  # HEAD + GET
    list(api.list_repo_tree(hub_dataset, repo_type="dataset"))
    api.repo_info(hub_dataset, repo_type="dataset")
    assert _http(hub_server, "/not/an/api", hub_token)[0] == 404
    assert _http(hub_server, f"/datasets/{hub_dataset}/resolve/main/run/1.txt", None)[0] == 401
    records = hub_server.requests
    counts = hub_server.counts()
    assert counts == {"api": 5, "resolver": 3, "commit": 3, "other": 1, "throttled": 1}
    assert {k: v for k, v in counts.items() if k != "throttled"} == dict(_by_path(records))
    assert [r.kind for r in records] == [
        "api", "commit", "api", "commit", "api", "commit", "resolver", "resolver", "api", "api",
        "other", "resolver"]
    assert all(r.kind == request_kind(r.method, r.path) for r in records)
    hub_server.clear_requests()
    assert hub_server.counts() == dict.fromkeys(
        ("api", "resolver", "commit", "other", "throttled"), 0)


def test_a_request_refused_401_counts_against_no_quota(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """Quotas apply after the token check, per account: wrong tokens do not use it up;
    injected faults come first and are not counted either."""
    hub_server.add_file(hub_dataset, "a.txt", "abc")
    hub_server.set_quota(requests=1, window_s=60)
    path = f"/datasets/{hub_dataset}/resolve/main/a.txt"
    assert [_http(hub_server, path, "hf_wrong")[0] for _ in range(3)] == [401] * 3
    hub_server.fail("GET", r"/resolve/", status=503, times=2)
    assert [_http(hub_server, path, hub_token)[0] for _ in range(2)] == [503, 503]
    assert _http(hub_server, path, hub_token)[0] == 200
    assert _http(hub_server, path, hub_token)[0] == 429
    assert hub_server.counts()["throttled"] == 1


def test_the_quota_holds_under_concurrent_requests(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """The server is threaded: concurrent requests never overrun a quota."""
    hub_server.add_file(hub_dataset, "a.txt", "abc")
    hub_server.set_quota(requests=5, window_s=60)
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(20)

    def head() -> None:
        start.wait()
        status = _http(hub_server, f"/datasets/{hub_dataset}/resolve/main/a.txt", hub_token,
                       method="HEAD")[0]
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=head) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(statuses) == [200] * 5 + [429] * 15
    assert hub_server.counts() == {"api": 0, "resolver": 20, "commit": 0, "other": 0,
                                   "throttled": 15}


def test_set_quota_starts_afresh_and_lifts_quotas(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """set_quota() replaces the quota and forgets what was counted; set_quota() lifts it."""
    path = f"/api/datasets/{hub_dataset}/commit/main"
    hub_server.set_quota(commits=1, window_s=60)
    assert _http(hub_server, path, hub_token, method="POST", data=b"")[0] == 200
    assert _http(hub_server, path, hub_token, method="POST", data=b"")[0] == 429
    hub_server.set_quota(commits=1, window_s=60)
    assert _http(hub_server, path, hub_token, method="POST", data=b"")[0] == 200
    assert hub_server.set_quota() == Quota()
    assert [_http(hub_server, path, hub_token, method="POST", data=b"")[0]
            for _ in range(3)] == [200] * 3


def test_quota_is_validated_and_set_at_construction(tmp_path: Path) -> None:
    for bad in ({"commits": -1}, {"requests": 1.5}, {"window_s": 0}, {"window_s": float("inf")},
                {"commits": True}):
        with pytest.raises(ValueError, match="must be"):
            Quota(**bad)
    with LocalHubServer(tmp_path / "hub", quota=Quota(commits=1, window_s=60)) as hub:
        hub.create_repo("org/data")
        path = "/api/datasets/org/data/commit/main"
        assert hub.quota == Quota(commits=1, window_s=60)
        assert [_http(hub, path, None, method="POST", data=b"")[0] for _ in range(2)] == [
            200, 429]
    # Constructor compatibility: a record built the old way gets its kind from its path.
    record = RequestRecord("POST", "/api/models/org/m/commit/main", "", None)
    assert (record.kind, record.throttled) == ("commit", None)


def test_the_command_line_sets_the_quotas(tmp_path: Path) -> None:
    """--commit-quota/--request-quota/--quota-window reach the served quota."""
    (tmp_path / "root" / "datasets" / "org" / "data").mkdir(parents=True)
    code = "from fsm.testing.hubserver import main; main()"
    with subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "root"), "--commit-quota", "1",
         "--request-quota", "2", "--quota-window", "60"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            hub = _UrlOnly(url)
            path = "/api/datasets/org/data/commit/main"
            # The second commit is refused by the commit quota, and counts against none.
            assert [_http(hub, path, None, method="POST", data=b"")[0] for _ in range(2)] == [
                200, 429]
            assert _http(hub, "/api/datasets/org/data", None)[0] == 200
            status, headers, _ = _http(hub, "/api/datasets/org/data", None)
            assert status == 429 and headers["RateLimit-Policy"].endswith("q=2;w=60")
        finally:
            assert proc.stdin is not None
            proc.stdin.close()  # the server stops when its stdin closes
            proc.wait(timeout=10)
    assert proc.returncode == 0
    with pytest.raises(SystemExit):
        main([str(tmp_path / "root"), "--commit-quota", "-1"])


class _UrlOnly:
    """Enough of a LocalHubServer for _http: a url."""

    def __init__(self, url: str) -> None:
        self.url = url
