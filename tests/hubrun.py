"""A whole attempt's world on the local Hub server, for the tests that run the runner and
a real worker against it through the real ``huggingface_hub`` client: ``HubRun`` and its
fixture ``hub_run`` (registered by conftest), which fails the test if the token shows up in
a structlog event, a stdlib log record, the runner's stderr, an outcome's reason or
failure, a marker, or any file under the test's directory (the server's repos included)
other than the payload that carries it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from conftest import WORKER_COMPLETION, RunDirs, assert_no_secret

import fsm
from fsm.attempt.runner import Outcome, run_attempt
from fsm.context import Settings
from fsm.store.hub import configure_transfer
from fsm.testing import LocalHubServer

# Before huggingface_hub is imported. Its log line is kept: the plugin loads before
# pytest captures anything, and the line surfaced after the session's summary.
with structlog.testing.capture_logs():
    configure_transfer(os.environ, accelerate=False)

REPO = "org/flash-runs"
PREFIX = "sft/run-1/seed3"
ARM = "lambda"
PROJECT_ROOT = Path(fsm.__file__).resolve().parents[1]
#: The store's call timeout in the fixture: a hung call is abandoned this soon.
CALL_TIMEOUT_S = 2.0

#: Every worker of this file starts with this: the worker side of CONTRACT section 5,
#: uploading through the real huggingface_hub client to the endpoint the runner names.
HUB_WORKER_PRELUDE = """
import json, os, sys, time
from pathlib import Path

from huggingface_hub import HfApi

if os.environ.get("FLASH_JOB_SPEC_PATH"):
    SPEC = json.loads(Path(os.environ["FLASH_JOB_SPEC_PATH"]).read_text())
else:
    SPEC = json.loads(os.environ["FLASH_JOB_SPEC_JSON"])
REPO = SPEC["hf_repo"]
PREFIX = SPEC["hf_prefix"]
SCRATCH = Path(os.environ["FLASH_SCRATCH_DIR"])
API = HfApi(endpoint=os.environ["HF_ENDPOINT"], token=os.environ["HF_TOKEN"])


def upload(local, name):
    API.upload_file(
        path_or_fileobj=str(local),
        path_in_repo=f"{PREFIX}/{name}",
        repo_id=REPO,
        repo_type="dataset",
        commit_message=f"worker: {name}",
    )

"""
HUB_WORKER_PRELUDE += WORKER_COMPLETION


class HubRun(RunDirs):
    """One attempt's world on the local Hub server: payload, scratch and code directories,
    the runner's logs, and the secret checks every test ends with."""

    def __init__(self, root: Path, server: LocalHubServer, token: str) -> None:
        super().__init__(root)
        self.server = server
        self.token = token
        self.secrets: list[str] = [token]
        self.logs: list[MutableMapping[str, Any]] = []
        self.stderr: list[bytes] = []
        self.texts: list[str] = []  # outcome reasons, failures and markers seen
        self.hard_exits: list[int] = []
        for sub in ("scratch", "runcode", "flash", "hf-home"):
            (root / sub).mkdir()
        server.create_repo(REPO)

    # --- where things are --------------------------------------------------------------

    @property
    def repo_dir(self) -> Path:
        return self.server.repo_dir(REPO)

    def artifact(self, name: str) -> Path:
        return self.repo_dir / PREFIX / name

    def marker(self, attempt: int = 0) -> dict[str, Any] | None:
        """The marker as it landed in the server's repo (None when it never did)."""
        path = self.artifact(f"{ARM}_attempt{attempt}.json")
        return json.loads(path.read_text()) if path.exists() else None

    def local_marker(self, attempt: int = 0) -> dict[str, Any] | None:
        """The runner's local copy of the marker in the scratch dir."""
        path = self.scratch / f"{ARM}_attempt{attempt}.json"
        return json.loads(path.read_text()) if path.exists() else None

    # --- setting up ----------------------------------------------------------------------

    def write_worker(self, body: str) -> None:
        self.server.add_file(
            REPO,
            "code/flash/engine/worker/__main__.py",
            HUB_WORKER_PRELUDE + "\n" + textwrap.dedent(body),
        )

    def payload(self, **overrides: Any) -> dict[str, Any]:
        spec = overrides.pop("spec", {})
        payload: dict[str, Any] = {
            "hf_repo": REPO,
            "hf_prefix": PREFIX,
            "phase": "sft",
            "seed": 3,
            "flash_arm": ARM,
            "attempt": 0,
            "run_id": "run-1",
            "max_wall_s": 120,
            "job_spec_json": json.dumps({"hf_repo": REPO, "hf_prefix": PREFIX, **spec}),
            "env": {"HF_TOKEN": self.token, "FLASH_STOP_GRACE_S": "2"},
        }
        payload.update(overrides)
        return {k: v for k, v in payload.items() if v is not None}

    def write_payload(self, **overrides: Any) -> Path:
        self.payload_path.write_text(json.dumps(self.payload(**overrides)))
        return self.payload_path

    def settings(self) -> Settings:
        return Settings(
            payload_path=self.payload_path,
            store_url=self.server.url,
            code_root=self.code_root,
            scratch_dir=self.scratch,
        )

    def environ(self) -> dict[str, str]:
        """The runner's environment (the worker inherits it, merged with the payload env).

        The project root leads PYTHONPATH so a runner process finds ``fsm`` even where the
        project is not installed in the venv; the worker runs with the same interpreter,
        so it finds ``huggingface_hub`` in the venv's site-packages.
        """
        path = [str(PROJECT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        return {
            **os.environ,
            "HF_HOME": str(self.root / "hf-home"),
            "PYTHONPATH": os.pathsep.join(path),
        }

    # --- running -------------------------------------------------------------------------

    def _hard_exit(self, code: int) -> None:
        self.hard_exits.append(code)  # the watchdog fired: the test fails after the run

    def run(self, **payload: Any) -> Outcome:
        """One attempt in this process (signals not installed), the console to a file."""
        self.write_payload(**payload)
        with (
            structlog.testing.capture_logs() as logs,
            open(self.root / "stdout.bin", "ab") as out,
        ):
            outcome = run_attempt(
                self.settings(),
                self.environ(),
                out_fd=out.fileno(),
                handle_signals=False,
                hard_exit=self._hard_exit,
            )
        self.logs.extend(logs)
        self.texts += [outcome.reason, repr(outcome.context.failure), json.dumps(outcome.marker)]
        assert self.hard_exits == [], "the deadline watchdog fired"
        return outcome

    def cli(self, **payload: Any) -> subprocess.CompletedProcess[bytes]:
        """``python -m fsm run --store http://...`` as a real process."""
        self.write_payload(**payload)
        proc = subprocess.run(
            [
                sys.executable, "-m", "fsm", "run",
                "--payload", str(self.payload_path),
                "--store", self.server.url,
                "--code-root", str(self.code_root),
                "--scratch-dir", str(self.scratch),
            ],
            env=self.environ(),
            capture_output=True,
            timeout=60,
            check=False,
        )
        self.stderr.append(proc.stderr)
        return proc

    def args(self, *, store: bool = True) -> list[str]:
        return [
            sys.executable, "-m", "fsm", "run",
            "--payload", str(self.payload_path),
            *(["--store", self.server.url] if store else []),
            "--code-root", str(self.code_root),
            "--scratch-dir", str(self.scratch),
        ]

    def start(self, **payload: Any) -> subprocess.Popen[bytes]:
        """The runner as a real process, left running (signals are the test's to send)."""
        self.write_payload(**payload)
        return subprocess.Popen(
            self.args(), env=self.environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )

    def finish(self, proc: subprocess.Popen[bytes], timeout: float = 30) -> bytes:
        """Wait for a started runner; its stderr (kept for the secret checks)."""
        _, err = proc.communicate(timeout=timeout)
        self.stderr.append(err)
        return err

    def stopped_within_docker(self, proc: subprocess.Popen[bytes], status: int) -> bytes:
        """SIGTERM to a started runner, as ``docker stop`` sends it: the runner must exit
        with ``status`` within Docker's 10 s stop timeout. Its stderr."""
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        err = self.finish(proc, timeout=30)
        elapsed = time.monotonic() - sent
        assert proc.returncode == status, err.decode()[-3000:]
        assert elapsed < 10, elapsed
        return err

    def interrupted_within_stop(self, proc: subprocess.Popen[bytes]) -> bytes:
        """:meth:`stopped_within_docker` with the retriable ``interrupted`` marker
        published (exit 75)."""
        err = self.stopped_within_docker(proc, 75)
        marker = self.marker()
        assert marker is not None
        assert (marker["retriable"], marker["rule"]) == (True, "interrupted"), marker
        return err

    # --- the secret checks ---------------------------------------------------------------

    def assert_no_secret_anywhere(self, caplog_text: str) -> None:
        logged = json.dumps(self.logs, default=str)
        for secret in self.secrets:
            assert secret not in logged, "a secret reached a structlog event"
            assert secret not in caplog_text, "a secret reached a stdlib log record"
            for stderr in self.stderr:
                assert secret.encode() not in stderr, "a secret reached the runner's stderr"
            for text in self.texts:
                assert secret not in text, "a secret reached an outcome, failure or marker"
            # The server's repos, the scratch dir (local marker, console, spec), the code
            # root, the caches and the persisted result: everything but the payload.
            assert_no_secret(self.root, secret)


@pytest.fixture
def hub_run(
    tmp_path: Path,
    hub_server: LocalHubServer,
    hub_token: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> Iterator[HubRun]:
    """A run laid out on the local Hub server; the secret checks run after the test."""
    caplog.set_level(logging.DEBUG)
    for var, value in {
        "FLASH_STORE_CALL_TIMEOUT_S": str(CALL_TIMEOUT_S),
        "FLASH_STORE_TRANSFER_TIMEOUT_S": "20",
        "FLASH_STORE_MAX_ATTEMPTS": "3",
        "FLASH_STORE_RETRY_BASE_S": "0.05",
        "FLASH_STORE_RETRY_MAX_S": "0.2",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("FLASH_STORE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    run = HubRun(tmp_path, hub_server, hub_token)
    yield run
    assert run.hard_exits == [], "the deadline watchdog fired"
    run.assert_no_secret_anywhere(caplog.text)


def agent_of(runner: int) -> int:
    """The runner's agent: its child in a session of its own running the runner's own
    program (a fork) or ``fsm.hub.agent`` (a fresh interpreter); the worker is neither.
    A child the runner forks to exec another program (an nvidia-smi query, started with a
    session of its own) looks the same until its exec: with such children about, call it
    once they run their own programs."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{runner}/cmdline", "rb") as f:
            runner_argv = f.read()  # empty until the runner's exec is through
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read()
            except OSError:
                continue
            if (int(fields[1]) == runner and int(fields[3]) == int(entry)
                    and ((runner_argv and argv == runner_argv) or b"fsm.hub.agent" in argv)):
                return int(entry)
        time.sleep(0.02)
    raise AssertionError(f"runner {runner} has no agent")
