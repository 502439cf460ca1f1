"""The store's own clock, for the lease (CONTRACT section 10), on both stores.

* ``changes(folder)``: the files directly in a folder, each with when it last changed by
  the store's clock (a local file's modification time; the date of the Hub commit that
  last touched it, from one expanded tree listing);
* ``head_time()``: when the repo last took a commit (the Hub's ``lastModified``, asked for
  alone); ``head_time(until)``: its newest commit at or before a moment (the Hub's history,
  read newest first as far as that commit);
* ``commit(..., delete=...)``: paths removed in the same commit, a missing one no error
  (the marker's commit removes the attempt's lease).

The Hub's side goes through the real ``huggingface_hub`` client (in the agent process)
against the local Hub server; those tests are marked ``hub``, so that CI runs them on the
0.x line too. Times are checked against the wall clock read around each call, never by
sleeping: a local file's modification time comes from the kernel's coarse clock (a tick
behind ``time.time()`` at most), and the Hub dates commits to the millisecond (truncated),
hence ``SLACK``. A file seeded "an hour ago" (backdated) tells a time that moved from one
that did not.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog.testing

from fsm.clock import Deadline
from fsm.errors import StoreNotFound
from fsm.store.base import Fence, Store
from fsm.store.hub import HubStore, configure_transfer
from fsm.store.local import LocalStore
from fsm.testing import LocalHubServer
from fsm.testing.hubserver import hub_date

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

REPO = "flash/changes"
TOKEN = "hf_canary_changes_0123456789"
#: How far a store's time may sit before the wall clock read just before the call.
SLACK = 0.05
HOUR_AGO = 3600.0

RUN = "sft/r1"
LEASE = f"{RUN}/lambda_attempt0.lease.json"
MARKER = f"{RUN}/lambda_attempt0.json"
CONSOLE = f"{RUN}/console_sft.txt"
NEVER_THERE = f"{RUN}/lambda_attempt7.lease.json"


@dataclass
class Bed:
    kind: str
    store: Store
    #: Seed a file behind the store's back, changed at ``when`` (now when None).
    put: Callable[[str, bytes, float | None], None]
    #: Whether the repo holds the file (looked at behind the store's back).
    holds: Callable[[str], bool]
    #: The wall clock just before the repo was made.
    began: float
    server: LocalHubServer | None = None


@pytest.fixture(params=["local", pytest.param("hub", marks=pytest.mark.hub)])
def bed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bed]:
    began = time.time()
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()

        def put(path: str, data: bytes, when: float | None) -> None:
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            if when is not None:
                os.utime(target, (when, when))

        yield Bed("local", LocalStore(root, deadline=Deadline.after(60)), put,
                  lambda path: (root / path).is_file(), began)
        return
    with structlog.testing.capture_logs() as events, \
            LocalHubServer(tmp_path / "hub", token=TOKEN) as server:
        server.create_repo(REPO)

        def put_hub(path: str, data: bytes, when: float | None) -> None:
            server.add_file(REPO, path, data, when=when)

        store = HubStore(REPO, token=TOKEN, deadline=Deadline.after(60), endpoint=server.url,
                         call_timeout_s=10, retry_base_s=0.01)
        yield Bed("hub", store, put_hub,
                  lambda path: (server.repo_dir(REPO) / path).is_file(), began, server)
    assert TOKEN not in repr(events)


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / "uploads" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _within(value: float, before: float, after: float) -> bool:
    return before - SLACK <= value <= after + SLACK


# --- changes() ------------------------------------------------------------------------------


def test_changes_lists_the_folders_files_with_their_commits_time(
    bed: Bed, tmp_path: Path,
) -> None:
    """Exactly the files directly in the folder (not a subfolder, nor its files, nor a
    file elsewhere), each dated within the wall-clock window of the commit that wrote it."""
    bed.put(f"{RUN}/logs/train.log", b"below the folder", None)
    bed.put("sft/r2/lambda_attempt0.lease.json", b"another run", None)
    bed.put("sft/r1.json", b"beside the folder", None)
    before = time.time()
    assert bed.store.commit({LEASE: _file(tmp_path, "lease", b'{"seq": 1}'),
                             CONSOLE: _file(tmp_path, "console", b"tail")},
                            message="lease and tail")
    after = time.time()
    changed = bed.store.changes(RUN)
    assert sorted(changed) == ["console_sft.txt", "lambda_attempt0.lease.json"]
    assert all(_within(when, before, after) for when in changed.values()), (
        before, changed, after)
    assert bed.store.changes(f"{RUN}/") == changed  # a trailing slash names the same folder


def test_changes_of_a_missing_folder_is_empty(bed: Bed) -> None:
    """No such folder (in a repo that has others) is an empty answer, not an error."""
    bed.put(f"{RUN}/lambda_attempt0.json", b"{}", None)
    assert bed.store.changes("sft/r9") == {}
    assert bed.store.changes(f"{RUN}/lambda_attempt0.json/x") == {}


def test_a_later_commit_moves_the_rewritten_files_time_and_not_the_others(
    bed: Bed, tmp_path: Path,
) -> None:
    """Files seeded an hour ago keep that time; the one a commit rewrites takes the
    commit's time; a file the commit does not touch keeps its own to the millisecond."""
    old = time.time() - HOUR_AGO
    bed.put(LEASE, b'{"seq": 1}', old)
    bed.put(CONSOLE, b"tail", old)
    first = bed.store.changes(RUN)
    assert sorted(first) == ["console_sft.txt", "lambda_attempt0.lease.json"]
    assert all(abs(when - old) <= 0.002 for when in first.values()), (old, first)
    before = time.time()
    assert bed.store.commit({LEASE: _file(tmp_path, "lease", b'{"seq": 2}')},
                            message="renew the lease")
    after = time.time()
    second = bed.store.changes(RUN)
    assert _within(second["lambda_attempt0.lease.json"], before, after), (before, second, after)
    assert second["console_sft.txt"] == first["console_sft.txt"]


def test_two_commits_in_a_row_each_date_their_own_files(bed: Bed, tmp_path: Path) -> None:
    """Two commits through the store: each file is dated within its own commit's window,
    and the second commit leaves the first one's other file as it was."""
    before1 = time.time()
    assert bed.store.commit({LEASE: _file(tmp_path, "l1", b"1"),
                             CONSOLE: _file(tmp_path, "c1", b"1")}, message="first")
    after1 = time.time()
    first = bed.store.changes(RUN)
    before2 = time.time()
    assert bed.store.commit({LEASE: _file(tmp_path, "l2", b"2")}, message="second")
    after2 = time.time()
    second = bed.store.changes(RUN)
    assert all(_within(when, before1, after1) for when in first.values()), first
    assert _within(second["lambda_attempt0.lease.json"], before2, after2)
    assert second["lambda_attempt0.lease.json"] >= first["lambda_attempt0.lease.json"]
    assert second["console_sft.txt"] == first["console_sft.txt"]


# --- head_time() ----------------------------------------------------------------------------


def test_head_time_is_the_last_commits_time_and_moves_with_a_commit(
    bed: Bed, tmp_path: Path,
) -> None:
    """A repo whose last commit is an hour old says so; a commit moves it to that
    commit's window, whatever folder the commit wrote."""
    old = time.time() - HOUR_AGO
    bed.put("a/old.json", b"{}", old)
    bed.put(CONSOLE, b"tail", old)
    stale = bed.store.head_time()
    assert stale is not None and abs(stale - old) <= 0.002, (old, stale)
    before = time.time()
    assert bed.store.commit({"b/c/new.json": _file(tmp_path, "new", b"{}")}, message="new")
    after = time.time()
    fresh = bed.store.head_time()
    assert fresh is not None and _within(fresh, before, after), (before, fresh, after)


def test_head_time_of_an_empty_repo(bed: Bed) -> None:
    """A local store without a file cannot say (None); a new Hub repo's last commit is its
    creation (the Hub's initial commit), dated when the fixture made it."""
    when = bed.store.head_time()
    if bed.kind == "local":
        assert when is None
    else:
        assert when is not None and _within(when, bed.began, time.time())


@pytest.mark.hub
def test_hub_head_time_asks_for_last_modified_alone(bed_hub: Bed) -> None:
    """On the Hub, head_time is one request for the repo's info with ``expand=lastModified``
    (no listing of its files, no file metadata), and a missing repo says None."""
    server = bed_hub.server
    assert server is not None
    server.clear_requests()
    assert bed_hub.store.head_time() == pytest.approx(server.last_modified(REPO), abs=0.002)
    info = [r for r in server.requests if r.kind == "api"]
    assert [(r.method, r.path, r.query) for r in info] == [
        ("GET", f"/api/datasets/{REPO}", "expand=lastModified")]
    nowhere = HubStore("flash/nowhere", token=TOKEN, deadline=Deadline.after(60),
                       endpoint=server.url, call_timeout_s=10, retry_base_s=0.01)
    assert nowhere.head_time() is None
    assert nowhere.changes(RUN) == {}


def test_head_time_until_is_the_newest_commit_at_or_before_it(bed: Bed) -> None:
    """A repo that keeps taking commits: its last commit says nothing of what landed
    before a moment; ``head_time(until)`` is the newest commit at or before it, and None
    when every commit is later."""
    now = time.time()
    for k, age in enumerate([3000, 2000, 1000, 100]):
        bed.put(f"sft/run-{k}/console_sft.txt", b"tail", now - age)
    # (The Hub's repo was made, its first commit, within the last 50 s.)
    for until, expected in [(now - 1500, now - 2000), (now - 1000, now - 1000),
                            (now - 999, now - 1000), (now - 50, now - 100)]:
        when = bed.store.head_time(until=until)
        assert when is not None and abs(when - expected) <= 0.002, (until, when, expected)
    assert bed.store.head_time(until=now - 5000) is None


@pytest.mark.hub
def test_hub_head_time_until_reads_the_history_newest_first_and_stops(bed_hub: Bed) -> None:
    """On the Hub, ``head_time(until)`` reads the repo's commits (pages of 50, newest
    first, through the library's paging) only as far as the first commit at or before
    ``until``: one page when it is recent, three when it is 120 commits back."""
    server = bed_hub.server
    assert server is not None
    now = time.time()
    for k in range(130):  # a commit a minute, the newest a minute ago
        server.add_file(REPO, f"sft/run-{k % 7}/console_sft.txt", f"{k}", when=now - 60 * (130 - k))
    for back, pages in [(3, 1), (120, 3)]:
        server.clear_requests()
        when = bed_hub.store.head_time(until=now - 60 * back - 1)
        assert when is not None and abs(when - (now - 60 * (back + 1))) <= 0.002, (back, when)
        listed = [r for r in server.requests if "/commits/" in r.path]
        assert len(listed) == pages, [(r.path, r.query) for r in listed]
        assert all(r.path == f"/api/datasets/{REPO}/commits/main" for r in listed)


@pytest.fixture
def bed_hub(tmp_path: Path) -> Iterator[Bed]:
    """The Hub bed alone."""
    began = time.time()
    with LocalHubServer(tmp_path / "hub", token=TOKEN) as server:
        server.create_repo(REPO)
        store = HubStore(REPO, token=TOKEN, deadline=Deadline.after(60), endpoint=server.url,
                         call_timeout_s=10, retry_base_s=0.01)
        yield Bed("hub", store, lambda p, d, w: None,
                  lambda path: (server.repo_dir(REPO) / path).is_file(), began, server)


# --- commit(delete=...) ---------------------------------------------------------------------


@pytest.mark.parametrize("fenced", [False, True], ids=["must-land", "fenced"])
def test_a_commit_removes_what_it_deletes_and_a_missing_one_is_no_error(
    bed: Bed, tmp_path: Path, fenced: bool,
) -> None:
    """The marker's commit removes the lease that is there and names one that never was:
    the marker lands, the lease is gone, nothing fails, and it is one commit."""
    bed.put(LEASE, b'{"seq": 3}', None)
    bed.put(CONSOLE, b"tail", None)
    landed = bed.store.commit({MARKER: _file(tmp_path, "marker", b'{"ok": true}')},
                              message="marker", fence=Fence() if fenced else None,
                              delete=[LEASE, NEVER_THERE])
    assert landed is True
    assert bed.store.list_folder(RUN) == frozenset({"lambda_attempt0.json", "console_sft.txt"})
    assert not bed.holds(LEASE) and not bed.holds(NEVER_THERE)
    assert bed.holds(MARKER) and bed.holds(CONSOLE)
    assert bed.store.download_file(MARKER, tmp_path / "dl").read_bytes() == b'{"ok": true}'
    assert bed.store.stats.evidence()["commits"] == 1
    if bed.server is not None:  # one call of the store's: refused once, then made
        assert sum(bed.store.stats.calls.get(op, 0) for op in ("upload", "commit")) == 1
        posts = [r.status for r in bed.server.requests if r.kind == "commit"]
        assert posts == [404, 200]


def test_a_commit_that_only_deletes_removes_those_files(bed: Bed, tmp_path: Path) -> None:
    """No file to write, one to delete: it goes, the folder's other file stays."""
    bed.put(LEASE, b"{}", None)
    bed.put(CONSOLE, b"tail", None)
    assert bed.store.commit({}, message="drop the lease", delete=[LEASE]) is True
    assert sorted(bed.store.changes(RUN)) == ["console_sft.txt"]
    assert not bed.holds(LEASE)


def test_deleting_only_missing_paths_lands_the_files(bed: Bed, tmp_path: Path) -> None:
    """Every path to delete is missing: the files still land."""
    assert bed.store.commit({MARKER: _file(tmp_path, "marker", b"{}")}, message="marker",
                            delete=[LEASE, NEVER_THERE]) is True
    assert bed.store.list_folder(RUN) == frozenset({"lambda_attempt0.json"})


def test_a_path_both_written_and_deleted_is_refused(bed: Bed, tmp_path: Path) -> None:
    """Writing and deleting one path in one commit is a caller's mistake: nothing lands."""
    with pytest.raises(ValueError, match="both write and delete"):
        bed.store.commit({LEASE: _file(tmp_path, "lease", b"{}")}, message="x",
                         delete=[LEASE])
    assert not bed.holds(LEASE)


def test_a_fenced_commit_with_deletions_after_the_seal_lands_nothing(
    bed: Bed, tmp_path: Path,
) -> None:
    """Sealed before it starts: False, the lease it would delete is still there, the file
    it would write is not, and the Hub was sent no commit."""
    bed.put(LEASE, b'{"seq": 1}', None)
    fence = Fence()
    fence.seal()
    landed = bed.store.commit({CONSOLE: _file(tmp_path, "console", b"late")},
                              message="late tail", fence=fence, delete=[LEASE])
    assert landed is False
    assert bed.holds(LEASE) and not bed.holds(CONSOLE)
    assert bed.store.stats.evidence()["commits"] == 0
    if bed.server is not None:
        assert bed.server.counts()["commit"] == 0


@pytest.mark.hub
def test_a_held_lease_renewal_after_the_marker_removed_the_lease_is_refused(
    bed_hub: Bed, tmp_path: Path,
) -> None:
    """A fenced commit renewing the lease is held by the Hub; the fence is sealed and the
    marker's commit removes the lease; the held renewal then meets 412 and returns False:
    the lease does not come back after the marker."""
    import threading

    server = bed_hub.server
    assert server is not None
    server.add_file(REPO, LEASE, b'{"seq": 1}')
    fence = Fence()
    server.hang("POST", r"/commit/", seconds=3)
    result: list[object] = []
    renewal = threading.Thread(target=lambda: result.append(bed_hub.store.commit(
        {LEASE: _file(tmp_path, "lease", b'{"seq": 2}'),
         CONSOLE: _file(tmp_path, "console", b"tail")},
        message="tail and lease", fence=fence)), daemon=True)
    renewal.start()
    assert server.wait_for(lambda log: any(r.fault == "hang" for r in log), timeout=10)
    fence.seal()
    assert bed_hub.store.commit({MARKER: _file(tmp_path, "marker", b"{}")}, message="marker",
                                delete=[LEASE]) is True
    renewal.join(timeout=15)
    assert not renewal.is_alive()
    assert result == [False]
    held = next(r for r in server.requests if r.fault == "hang")
    assert held.status == 412
    repo = server.repo_dir(REPO)
    assert not (repo / LEASE).exists() and not (repo / CONSOLE).exists()
    assert (repo / MARKER).is_file()


@pytest.mark.hub
def test_a_refusal_that_is_not_about_a_deletion_stands(bed_hub: Bed, tmp_path: Path) -> None:
    """The Hub answers 404 EntryNotFound though every path to delete is there: the client
    does not drop a deletion it cannot blame, the refusal stands (StoreNotFound for a
    must-land commit), and the repo is as it was."""
    server = bed_hub.server
    assert server is not None
    server.add_file(REPO, LEASE, b"{}")
    server.fail("POST", r"/commit/", status=404, error_code="EntryNotFound")
    with pytest.raises(StoreNotFound):
        bed_hub.store.commit({MARKER: _file(tmp_path, "marker", b"{}")}, message="marker",
                             delete=[LEASE])
    assert (server.repo_dir(REPO) / LEASE).is_file()
    assert not (server.repo_dir(REPO) / MARKER).exists()
    assert [r.status for r in server.requests if r.kind == "commit"] == [404]


# --- the local Hub server, as the Hub answers -----------------------------------------------


def _get_json(server: LocalHubServer, path: str) -> object:
    request = urllib.request.Request(f"{server.url}{path}",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


@pytest.mark.hub
def test_hubserver_expanded_listing_names_each_files_last_commit(
    bed_hub: Bed, tmp_path: Path,
) -> None:
    """Through the real client: ``list_repo_tree(expand=True)`` gives each file the id,
    title and date of the commit that last wrote it, and a folder the newest of its
    files'; the Hub's expanded pages are 50 entries."""
    from huggingface_hub import CommitOperationAdd, HfApi

    server = bed_hub.server
    assert server is not None
    api = HfApi(endpoint=server.url, token=TOKEN)
    before = time.time()
    made = api.create_commit(REPO, repo_type="dataset", commit_message="first", operations=[
        CommitOperationAdd(path_in_repo=f"{RUN}/{i:03d}.json",
                           path_or_fileobj=_file(tmp_path, f"{i}", b"{}").as_posix())
        for i in range(60)])
    after = time.time()
    second = api.create_commit(REPO, repo_type="dataset", commit_message="second", operations=[
        CommitOperationAdd(path_in_repo=f"{RUN}/sub/x.json",
                           path_or_fileobj=_file(tmp_path, "x", b"x").as_posix())])
    server.clear_requests()
    items = list(api.list_repo_tree(REPO, path_in_repo=RUN, repo_type="dataset", expand=True))
    pages = [r for r in server.requests if "/tree/" in r.path]
    assert len(items) == 61 and len(pages) == 2  # 50 + 11
    files = {item.path: item.last_commit for item in items}
    first_file = files[f"{RUN}/000.json"]
    assert first_file is not None
    assert (first_file.oid, first_file.title) == (made.oid, "first")
    assert _within(first_file.date.timestamp(), before, after)
    folder = files[f"{RUN}/sub"]
    assert folder is not None and (folder.oid, folder.title) == (second.oid, "second")
    server.clear_requests()
    assert len(list(api.list_repo_tree(REPO, path_in_repo=RUN, repo_type="dataset"))) == 61
    assert len([r for r in server.requests if "/tree/" in r.path]) == 1  # 1,000 a page


@pytest.mark.hub
def test_hubserver_repo_info_expand_answers_the_named_fields_alone(bed_hub: Bed) -> None:
    """``lastModified`` is the repo's last commit (a backdated one included), and
    ``expand=`` answers only the named fields with the repo's ids."""
    server = bed_hub.server
    assert server is not None
    old = time.time() - HOUR_AGO
    server.add_file(REPO, "a.json", b"{}", when=old)
    full = _get_json(server, f"/api/datasets/{REPO}")
    assert isinstance(full, dict) and full["lastModified"] == hub_date(old)
    assert "siblings" in full and "sha" in full
    only = _get_json(server, f"/api/datasets/{REPO}?expand=lastModified")
    assert only == {"id": REPO, "_id": full["_id"], "lastModified": hub_date(old)}
    both = _get_json(server, f"/api/datasets/{REPO}?expand=lastModified&expand=sha")
    assert isinstance(both, dict) and sorted(both) == ["_id", "id", "lastModified", "sha"]


@pytest.mark.hub
def test_hubserver_deleting_a_missing_file_refuses_the_whole_commit(
    bed_hub: Bed, tmp_path: Path,
) -> None:
    """As the Hub: a commit deleting a missing file is 404 EntryNotFound and writes
    nothing, not even its other operations; a folder a deletion empties goes."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import EntryNotFoundError

    server = bed_hub.server
    assert server is not None
    server.add_file(REPO, LEASE, b"{}")
    api = HfApi(endpoint=server.url, token=TOKEN)
    head = server.commit_sha(REPO)
    with pytest.raises(EntryNotFoundError):
        api.create_commit(REPO, repo_type="dataset", commit_message="x", operations=[
            CommitOperationAdd(path_in_repo=MARKER,
                               path_or_fileobj=_file(tmp_path, "m", b"{}").as_posix()),
            CommitOperationDelete(path_in_repo=LEASE),
            CommitOperationDelete(path_in_repo=NEVER_THERE)])
    repo = server.repo_dir(REPO)
    assert (repo / LEASE).is_file() and not (repo / MARKER).exists()
    assert server.commit_sha(REPO) == head
    api.create_commit(REPO, repo_type="dataset", commit_message="y",
                      operations=[CommitOperationDelete(path_in_repo=LEASE)])
    assert not (repo / RUN).exists()
    infos = api.get_paths_info(REPO, [LEASE, "nowhere.json"], repo_type="dataset")
    assert infos == []
