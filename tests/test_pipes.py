"""Every command of the CLI behaves in a pipe as Unix tools do (``fsm/cli.py``): when the
reader has gone (``| head -1`` has its line), a command that still writes leaves quietly,
killed by SIGPIPE as ``cat`` or ``ls`` would be (the shell sees 141), with nothing on stderr:
no traceback, no "internal error". ``run`` is the exception by design: its own output never
raises, so it finishes its attempt and exits with the attempt's status.

Each command runs as a real process (``python -m fsm``) whose stdout is a pipe whose read
end is closed before it starts (every write fails: no race with a fast reader), and once
more under a real ``sh -c '... | head -1'``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ARM, PREFIX, REPO, Layout

#: What the child inherits must not pick a store or a token for it.
_AMBIENT = ("FLASH_STORE", "HF_TOKEN", "HF_ENDPOINT")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _AMBIENT}


def _into_closed_pipe(args: list[str], timeout: float = 60) -> tuple[int, str]:
    """``python -m fsm ARGS`` with stdout a pipe nobody reads any more: (status, stderr)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "fsm", *args], stdout=write,
                              stderr=subprocess.PIPE, env=_env(), timeout=timeout, check=False)
    finally:
        os.close(write)
    return proc.returncode, proc.stderr.decode("utf-8", "replace")


def _under_head(args: list[str], timeout: float = 60) -> tuple[str, str]:
    """``python -m fsm ARGS | head -1`` in a real shell: (head's output, the command's
    stderr, which is the shell's: head writes none)."""
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "fsm", *args])
    proc = subprocess.run(["sh", "-c", f"{command} | head -1"], env=_env(),
                          capture_output=True, timeout=timeout, check=False)
    return proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local store with a prefix of 300 attempts (status prints more than a pipe holds)."""
    root = tmp_path_factory.mktemp("pipes") / "store"
    folder = root / PREFIX
    folder.mkdir(parents=True)
    now = time.time()
    for n in range(300):
        (folder / f"{ARM}_attempt{n}.json").write_text(json.dumps({
            "ok": False, "ts": now - n, "attempt": n, "retriable": n % 2 == 0,
            "error": "worker exited 1 " + "x" * 200, "state": "VerifyRemote",
            "rule": "worker-failed", "run_id": "run-1", "path": ["LoadPayload", "Mark"],
        }))
    (folder / "console_sft.txt").write_text("".join(f"line {i}\n" for i in range(50)))
    return root


def _commands(store: Path) -> dict[str, list[str]]:
    at = ["--repo", REPO, "--prefix", PREFIX, "--store", store.as_uri()]
    return {
        "policy": ["policy"],
        "diagram": ["diagram"],
        "diagram-dot": ["diagram", "--format", "dot"],
        "status": ["status", *at],
        "status-json": ["status", "--json", *at],
        "status-recursive": ["status", "--recursive", *at[:2], "--prefix", "sft",
                             *at[4:]],
        "explain": ["explain", *at, "--attempt", "7"],
        "help": ["--help"],
        "status-help": ["status", "--help"],
        "demo": ["demo", "--scenario", "crash"],
    }


_NAMES = ["policy", "diagram", "diagram-dot", "status", "status-json", "status-recursive",
          "explain", "help", "status-help", "demo"]


@pytest.mark.parametrize("name", _NAMES)
def test_a_command_writing_into_a_closed_pipe_leaves_quietly(store: Path, name: str) -> None:
    """Killed by SIGPIPE like a Unix tool, nothing on stderr (argparse's help, which
    swallows the error itself, exits 0)."""
    status, stderr = _into_closed_pipe(_commands(store)[name], timeout=120)
    if name == "demo":  # the demo's attempt logs on stderr; its end must not be a defect
        assert "internal error" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    else:
        assert stderr == ""
    assert status in (-signal.SIGPIPE, 0), (status, stderr[-2000:])
    if name not in ("help", "status-help"):
        assert status == -signal.SIGPIPE, (status, stderr[-2000:])


@pytest.mark.parametrize("name", _NAMES)
def test_a_command_under_head_prints_its_first_line_and_nothing_else(
    store: Path, name: str
) -> None:
    """``| head -1`` in a real shell: the first line, and no word on stderr."""
    first, stderr = _under_head(_commands(store)[name], timeout=120)
    assert first.count("\n") == 1 and first.strip(), first
    if name == "demo":
        assert "internal error" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    else:
        assert stderr == ""


def test_validate_into_a_closed_pipe_leaves_quietly(tmp_path: Path) -> None:
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({"hf_repo": REPO, "hf_prefix": PREFIX, "phase": "sft",
                                   "seed": 1, "job_spec_json": "{}"}))
    assert _into_closed_pipe(["validate", str(payload)]) == (-signal.SIGPIPE, "")
    first, stderr = _under_head(["validate", str(payload)])
    assert json.loads(first)["valid"] is True and stderr == ""


def test_a_bad_command_line_into_a_closed_pipe_still_says_why(store: Path) -> None:
    """Its one line goes to stderr, which is not the closed pipe: exit 2, as without it."""
    status, stderr = _into_closed_pipe(["status", "--repo", "bad", "--prefix", PREFIX])
    assert status == 2 and stderr.startswith("flash-bootstrap: --repo 'bad'"), stderr


def test_run_into_a_closed_pipe_finishes_its_attempt_and_exits_with_its_status(
    layout: Layout,
) -> None:
    """The worker's console and the runner's output go nowhere; the attempt still ends,
    its marker lands, and the status is the attempt's, not a signal's."""
    layout.write_worker("for i in range(20000):\n    print('line', i)\ncomplete()\n")
    layout.write_payload()
    status, stderr = _into_closed_pipe(layout.run_args())
    assert status == 0, stderr[-3000:]
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    assert stderr.strip().splitlines()[-1] == "flash-bootstrap: attempt 0 succeeded"
    assert "Traceback" not in stderr and "internal error" not in stderr
