"""The Hub adapter against a Hub we did not write: ``olah`` (PyPI), a self-hosted Hub mirror
serving local git repositories offline.

The runner's reads, as it makes them (``HubStore``: the code fetch, the spilled spec, a
preload's model warm), against olah serving a dataset and a model repo from git, and the
result compared byte for byte with what ``huggingface_hub.snapshot_download`` gets from
the same server. olah has no commit API, so the marker's commit is not part of this.

Skipped when olah or git is not installed (``pip install -e '.[olah]'``; ``OLAH_PYTHON``
names another interpreter that has it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm.clock import Deadline
from fsm.store import PRELOAD_IGNORE_PATTERNS
from fsm.store.hub import HubStore

pytestmark = [pytest.mark.hub]

#: The interpreter olah runs with: olah needs huggingface_hub 1.x or later, so on the 0.x
#: line the client's venv cannot hold it (``.ci/run`` names the 2.x venv's python).
OLAH_PYTHON = os.environ.get("OLAH_PYTHON") or (
    sys.executable if importlib.util.find_spec("olah") else None)
if OLAH_PYTHON is None:
    pytest.skip("olah is not installed (pip install -e '.[olah]', or set OLAH_PYTHON)",
                allow_module_level=True)
if shutil.which("git") is None:  # pragma: no cover - git is in the image
    pytest.skip("git is not installed", allow_module_level=True)

DATASET = "org/flash-runs"
MODEL = "org/tiny-model"
CODE = {
    "code/flash/__init__.py": b"",
    "code/flash/engine/worker/__main__.py": b"print('hello')\n",
    "code/flash/lib/weights.bin": bytes(range(256)) * 64,
    "code/README.md": "Ünïcode ✓\n".encode(),
}
SPEC = ("sft/run-1/seed3/job_spec.json", b'{"hf_repo": "org/flash-runs", "steps": 3}')
MODEL_FILES = {
    "config.json": b'{"model_type": "tiny"}',
    "tokenizer.json": b'{"vocab": [1, 2, 3]}',
    "model.safetensors": bytes(range(256)) * 256,
    "original/consolidated.pth": b"never fetched",
}


def _git_repo(path: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "c"]):
        subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def olah(tmp_path: Path) -> Iterator[str]:
    """olah on 127.0.0.1, offline, serving the two git repos; its endpoint."""
    mirrors = tmp_path / "mirrors"
    _git_repo(mirrors / "datasets" / DATASET, {**CODE, SPEC[0]: SPEC[1]})
    _git_repo(mirrors / "models" / MODEL, MODEL_FILES)
    port = _free_port()
    config = tmp_path / "olah.toml"
    config.write_text(
        "[basic]\n"
        f'host = "127.0.0.1"\nport = {port}\n'
        f'repos-path = "{tmp_path / "olah-repos"}"\n'
        f'mirror-netloc = "127.0.0.1:{port}"\nmirror-lfs-netloc = "127.0.0.1:{port}"\n'
        f'mirrors-path = ["{mirrors}"]\n'
        "[accessibility]\noffline = true\n")
    log = (tmp_path / "olah.log").open("wb")
    proc = subprocess.Popen([OLAH_PYTHON, "-c", "from olah.server import cli; cli()",
                             "--config", str(config)], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:  # a bounded poll for its port: olah prints no ready line
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "olah.log").read_text()[-3000:])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > end:
                    raise AssertionError("olah did not listen within 60 s") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _store(endpoint: str) -> HubStore:
    return HubStore(DATASET, token=None, deadline=Deadline.after(120), endpoint=endpoint,
                    call_timeout_s=30, retry_base_s=0.05, max_attempts=2)


def test_the_runners_reads_from_olah_are_byte_for_byte_what_snapshot_download_gets(
    olah: str, tmp_path: Path,
) -> None:
    """The code fetch, the spilled spec and a model warm from olah: the same bytes as
    ``snapshot_download`` of the same repos from the same server, and the warmed model
    is found by the library offline."""
    from huggingface_hub import snapshot_download

    store = _store(olah)
    fetched = tmp_path / "runcode"
    assert store.fetch_folder("code", fetched) == len(CODE)
    spec = store.download_file(SPEC[0], tmp_path / "scratch")
    cache = tmp_path / "hf-cache"
    assert store.warm_model(MODEL, cache, list(PRELOAD_IGNORE_PATTERNS)) == "downloaded"

    theirs = Path(snapshot_download(DATASET, repo_type="dataset", endpoint=olah,
                                    local_dir=str(tmp_path / "theirs"),
                                    allow_patterns=["code/**", SPEC[0]]))
    expected = {k: v for k, v in _tree(theirs).items() if not k.startswith(".cache/")}
    assert _tree(fetched) == {k: v for k, v in expected.items() if k.startswith("code/")}
    assert _tree(fetched) == CODE
    assert spec.read_bytes() == expected[SPEC[0]] == SPEC[1]

    model_theirs = Path(snapshot_download(MODEL, endpoint=olah,
                                          cache_dir=str(tmp_path / "their-cache"),
                                          ignore_patterns=list(PRELOAD_IGNORE_PATTERNS)))
    ours = Path(snapshot_download(MODEL, cache_dir=str(cache), local_files_only=True,
                                  ignore_patterns=list(PRELOAD_IGNORE_PATTERNS)))
    assert _tree(ours) == _tree(model_theirs)
    assert set(_tree(ours)) == {"config.json", "model.safetensors", "tokenizer.json"}


def test_a_path_olah_says_is_in_no_repo_is_missing_once_the_repo_has_answered(
    olah: str,
) -> None:
    """olah answers a missing folder's listing or a missing file's HEAD in a repo it serves
    with ``401`` and ``X-Error-Code: RepoNotFound`` (the Hub: ``404``): once the store has
    answered for the repo, the adapter reads that as missing, not as a refused token."""
    store = _store(olah)
    assert store.list_folder("code/flash") == {"__init__.py"}
    assert store.list_folder("nope") == frozenset()
    assert store.exists("code/nope.py") is False
    assert store.exists("code/flash/__init__.py") is True
