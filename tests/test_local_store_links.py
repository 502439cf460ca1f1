"""The local store stays inside its root (CONTRACT: ``file:///dir`` *is* the dataset repo).

A store entry that is a symbolic link resolving outside the store's root, or a dangling
link, is refused by every read (fetch_folder, download_file, exists, warm_model) with
``FatalError(rule=rules.STORE_UNSAFE_LINK)`` and one line naming the entry's repo path; links
that stay inside the root are followed. Checked at the adapter and through the real
runner as a process (``python -m fsm run``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import Layout

from fsm import rules
from fsm.clock import Deadline
from fsm.errors import FatalError
from fsm.store.base import PRELOAD_IGNORE_PATTERNS
from fsm.store.local import LocalStore

SECRET = b"OUTSIDE-THE-STORE-do-not-copy-3f9a"
RULE = rules.STORE_UNSAFE_LINK.id  # as the marker names it


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the store (not under it) holding a file that must stay put."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_bytes(SECRET)
    (path / "lib").mkdir()
    (path / "lib" / "mod.py").write_bytes(SECRET)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    worker = path / "code" / "flash" / "engine" / "worker" / "__main__.py"
    worker.parent.mkdir(parents=True)
    worker.write_text("print('worker')\n")
    return path


def _store(root: Path) -> LocalStore:
    return LocalStore(root, deadline=Deadline.after(60))


def _contains_secret(tree: Path) -> bool:
    return tree.exists() and any(
        p.is_file() and SECRET in p.read_bytes() for p in tree.rglob("*")
    )


def _assert_refused(info: pytest.ExceptionInfo[FatalError], repo_path: str) -> None:
    error = info.value
    assert error.rule is rules.STORE_UNSAFE_LINK
    assert not error.retriable
    assert repo_path in str(error)
    assert "\n" not in str(error)
    assert SECRET.decode() not in str(error)


# --- the adapter --------------------------------------------------------------------------


def test_fetch_refuses_a_file_link_leaving_the_root_and_copies_nothing(
    root: Path, outside: Path, tmp_path: Path
) -> None:
    """code/leak.py -> a file outside the store: refused, naming code/leak.py; nothing of
    the tree (the outside file least of all) reaches the code root."""
    (root / "code" / "leak.py").symlink_to(outside / "secret.txt")
    with pytest.raises(FatalError) as info:
        _store(root).fetch_folder("code", tmp_path / "runcode")
    _assert_refused(info, "code/leak.py")
    assert "leaves the store's root" in str(info.value)
    assert not _contains_secret(tmp_path / "runcode")
    assert not (tmp_path / "runcode" / "code").exists()  # checked before anything is copied


def test_fetch_refuses_a_linked_folder_leaving_the_root(
    root: Path, outside: Path, tmp_path: Path
) -> None:
    """code/vendor -> a folder outside the store is not walked: refused, naming it."""
    (root / "code" / "vendor").symlink_to(outside / "lib", target_is_directory=True)
    with pytest.raises(FatalError) as info:
        _store(root).fetch_folder("code", tmp_path / "runcode")
    _assert_refused(info, "code/vendor")
    assert not _contains_secret(tmp_path / "runcode")


def test_fetch_refuses_a_code_folder_that_is_itself_a_link_outside(
    tmp_path: Path, outside: Path
) -> None:
    """The fetched folder itself (code -> outside) is checked too."""
    root = tmp_path / "store"
    root.mkdir()
    (root / "code").symlink_to(outside, target_is_directory=True)
    with pytest.raises(FatalError) as info:
        _store(root).fetch_folder("code", tmp_path / "runcode")
    _assert_refused(info, "code")
    assert not _contains_secret(tmp_path / "runcode")


def test_fetch_refuses_a_dangling_link(root: Path, tmp_path: Path) -> None:
    """A link to nothing is refused as such (not a crash that ends 'unclassified')."""
    (root / "code" / "gone.py").symlink_to(tmp_path / "no-such-file")
    with pytest.raises(FatalError) as info:
        _store(root).fetch_folder("code", tmp_path / "runcode")
    _assert_refused(info, "code/gone.py")
    assert "dangling" in str(info.value)


def test_fetch_refuses_a_link_that_climbs_out_through_a_relative_path(
    root: Path, outside: Path, tmp_path: Path
) -> None:
    """A relative link (../../outside/...) and a chain of in-root links ending outside are
    judged by where they finally resolve."""
    (root / "hop").symlink_to(os.path.relpath(outside / "secret.txt", root))
    (root / "code" / "chained.py").symlink_to("../hop")
    with pytest.raises(FatalError) as info:
        _store(root).fetch_folder("code", tmp_path / "runcode")
    _assert_refused(info, "code/chained.py")


def test_links_that_stay_inside_the_root_are_followed(root: Path, tmp_path: Path) -> None:
    """A file link and a folder link resolving inside the store are fetched like plain
    entries; a link back to its own folder is not walked in circles."""
    (root / "shared").mkdir()
    (root / "shared" / "util.py").write_text("UTIL = 1\n")
    (root / "code" / "util.py").symlink_to("../shared/util.py")
    (root / "code" / "shared").symlink_to("../shared", target_is_directory=True)
    (root / "code" / "self").symlink_to(".", target_is_directory=True)
    count = _store(root).fetch_folder("code", tmp_path / "runcode")
    fetched = sorted(p.relative_to(tmp_path / "runcode").as_posix()
                     for p in (tmp_path / "runcode").rglob("*") if p.is_file())
    assert fetched == ["code/flash/engine/worker/__main__.py", "code/shared/util.py",
                       "code/util.py"]
    assert count == 3
    assert (tmp_path / "runcode" / "code" / "util.py").read_text() == "UTIL = 1\n"
    assert not (tmp_path / "runcode" / "code" / "util.py").is_symlink()


def test_download_and_exists_refuse_links_leaving_the_root(
    root: Path, outside: Path, tmp_path: Path
) -> None:
    """download_file and exists refuse a file link outside, a folder link outside on the
    way to the file, and a dangling link, each naming the entry."""
    (root / "sft").mkdir()
    (root / "sft" / "job_spec.json").symlink_to(outside / "secret.txt")
    (root / "sft" / "run").symlink_to(outside, target_is_directory=True)
    (root / "sft" / "DONE").symlink_to(tmp_path / "nothing-here")
    store = _store(root)
    for path_in_repo, named in (("sft/job_spec.json", "sft/job_spec.json"),
                                ("sft/run/secret.txt", "sft/run"),
                                ("sft/DONE", "sft/DONE")):
        with pytest.raises(FatalError) as info:
            store.download_file(path_in_repo, tmp_path / "dl")
        _assert_refused(info, named)
        with pytest.raises(FatalError) as info:
            store.exists(path_in_repo)
        _assert_refused(info, named)
    assert not _contains_secret(tmp_path / "dl")
    assert store.exists("code/flash/engine/worker/__main__.py") is True
    assert store.exists("sft/missing") is False


def test_warm_model_refuses_a_model_file_linking_outside(
    root: Path, outside: Path, tmp_path: Path
) -> None:
    """A model file that links outside the store is not warmed into the cache."""
    model = root / "models" / "org" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").symlink_to(outside / "secret.txt")
    with pytest.raises(FatalError) as info:
        _store(root).warm_model("org/tiny", tmp_path / "hub", list(PRELOAD_IGNORE_PATTERNS))
    _assert_refused(info, "models/org/tiny/model.safetensors")
    assert not _contains_secret(tmp_path / "hub")


def test_warm_model_skips_links_in_files_it_would_not_read(root: Path, tmp_path: Path) -> None:
    """An ignored file (*.pth) is never read, so even a dangling link there is no reason to
    refuse the model; the rest is warmed."""
    model = root / "models" / "org" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "w.pth").symlink_to(tmp_path / "nothing-here")
    cache = tmp_path / "hub"
    assert _store(root).warm_model("org/tiny", cache, list(PRELOAD_IGNORE_PATTERNS)) == (
        "downloaded")


# --- through the runner -------------------------------------------------------------------


def _run_refused(layout: Layout) -> tuple[int, list[str], dict[str, Any]]:
    layout.write_worker("complete()\n")
    layout.write_payload()
    done = layout.cli(*layout.run_args())
    stderr = done.stderr.decode(errors="replace")
    marker = layout.marker()
    assert marker is not None, stderr[-2000:]
    return done.returncode, stderr.splitlines(), marker


def _assert_one_human_line(lines: list[str], named: str) -> None:
    assert lines, "nothing on stderr"
    last = lines[-1]
    assert not last.lstrip().startswith(("{", "Traceback", "File ")), last
    assert named in last, last
    assert not any(line.startswith("Traceback (most recent call last)") for line in lines)


def test_runner_refuses_a_code_link_leaving_the_store(layout: Layout, tmp_path: Path) -> None:
    """``python -m fsm run`` with code/leak.py -> a file outside the store: exit 1, a fatal
    marker naming the rule and FetchCode, the outside content nowhere under the code root,
    and the last stderr line one human sentence."""
    secret = tmp_path / "outside.txt"
    secret.write_bytes(SECRET)
    (layout.store / "code").mkdir()
    (layout.store / "code" / "leak.py").symlink_to(secret)
    code, lines, marker = _run_refused(layout)
    assert code == 1
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, False, RULE, "FetchCode")
    assert "code/leak.py" in str(marker["error"])
    assert SECRET.decode() not in str(marker["error"])
    assert not _contains_secret(layout.code_root)
    assert not (layout.code_root / "code" / "leak.py").exists()
    _assert_one_human_line(lines, "code/leak.py")
    assert "Train" not in list(marker.get("path") or [])  # the worker never started


def test_runner_refuses_a_dangling_code_link(layout: Layout, tmp_path: Path) -> None:
    """A dangling link under code/ ends the attempt with the same rule, not 'unclassified'."""
    (layout.store / "code").mkdir()
    (layout.store / "code" / "gone.py").symlink_to(tmp_path / "no-such-file")
    code, lines, marker = _run_refused(layout)
    assert code == 1
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, False, RULE, "FetchCode")
    _assert_one_human_line(lines, "code/gone.py")
