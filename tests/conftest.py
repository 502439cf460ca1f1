"""Shared fixtures: a run laid out on a local store, with workers the tests write."""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, quote_plus

import pytest
import structlog
from hypothesis import HealthCheck, settings

from fsm.attempt.runner import Outcome, run_attempt
from fsm.clock import Deadline
from fsm.context import Settings
from fsm.output import log
from fsm.store.hub import HubStore
from fsm.testing import LocalHubServer

# The Hub fixtures (hub_token, hub_server, hub_dataset), and this suite's hub_run on top of
# them (tests/hubrun.py). The plugin is no pytest11 entry point, so it is loaded here, as
# users load it in their own suites (docs/testing.md).
pytest_plugins = ["fsm.testing.pytest_plugin", "hubrun"]

# Hypothesis profiles: "ci" (the default) stays fast; "thorough" is for deep runs:
#   HYPOTHESIS_PROFILE=thorough pytest tests/test_properties_*.py
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = "org/flash-runs"
PREFIX = "sft/run-1/seed3"
ARM = "lambda"
CANARY = "hf_CANARY_token_must_never_leak_0123456789"

#: Every test worker starts with this: it speaks the worker side of CONTRACT section 5
#: against the local store named by FLASH_STORE.
WORKER_PRELUDE = """
import json, os, shutil, sys, time
from pathlib import Path
from urllib.parse import unquote, urlparse

STORE = Path(unquote(urlparse(os.environ["FLASH_STORE"]).path))
if os.environ.get("FLASH_JOB_SPEC_PATH"):
    SPEC = json.loads(Path(os.environ["FLASH_JOB_SPEC_PATH"]).read_text())
else:
    SPEC = json.loads(os.environ["FLASH_JOB_SPEC_JSON"])
PREFIX = SPEC["hf_prefix"]
SCRATCH = Path(os.environ["FLASH_SCRATCH_DIR"])


def upload(local, name):
    target = STORE / PREFIX / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(local, str(target) + ".part")
    os.replace(str(target) + ".part", target)

"""

#: The worker side of success, on top of a prelude that defines ``upload`` and ``SCRATCH``:
#: write metrics.json, upload it, then DONE (CONTRACT section 5).
WORKER_COMPLETION = '''
def write_metrics():
    path = SCRATCH / "metrics.json"
    path.write_text(json.dumps({"loss": 0.25}))
    return path


def complete():
    upload(write_metrics(), "metrics.json")
    done = SCRATCH / "DONE"
    done.write_text(str(time.time()))
    upload(done, "DONE")
'''
WORKER_PRELUDE += WORKER_COMPLETION

#: A worker that says it is ready, waits for the test's go, then completes.
WAIT_FOR_GO = """
print("ready", flush=True)
go = SCRATCH / "go"
for _ in range(3000):
    if go.exists():
        break
    time.sleep(0.01)
complete()
"""


@pytest.fixture(autouse=True, scope="session")
def _logs_to_stderr() -> None:
    log.configure(sys.stderr, json=True)


#: The states a successful training attempt passes, in order.
TRAIN_PATH = [
    "LoadPayload", "InstallExtras", "FetchCode", "ResolveSpec", "Train", "VerifyRemote",
    "Mark", "Succeeded",
]


@dataclass
class RunDirs:
    """Where one attempt's local files live under ``root``, as the contract lays them out."""

    root: Path

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    @property
    def code_root(self) -> Path:
        return self.root / "runcode"

    @property
    def payload_path(self) -> Path:
        return self.root / "flash" / "payload.json"


@dataclass
class Layout(RunDirs):
    """One attempt's world: a local store, a payload, scratch and code directories."""

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def store_url(self) -> str:
        return self.store.as_uri()

    def write_worker(self, body: str) -> None:
        worker = self.store / "code" / "flash" / "engine" / "worker" / "__main__.py"
        worker.parent.mkdir(parents=True, exist_ok=True)
        worker.write_text(WORKER_PRELUDE + "\n" + textwrap.dedent(body))

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
            "job_spec_json": json.dumps({"hf_prefix": PREFIX, **spec}),
            "env": {"HF_TOKEN": CANARY, "FLASH_STOP_GRACE_S": "2"},
        }
        payload.update(overrides)
        return {k: v for k, v in payload.items() if v is not None}

    def write_payload(self, payload: dict[str, Any] | str | bytes | None = None, **kw: Any) -> Path:
        data = self.payload(**kw) if payload is None else payload
        if isinstance(data, dict):
            data = json.dumps(data)
        if isinstance(data, str):
            data = data.encode()
        self.payload_path.write_bytes(data)
        return self.payload_path

    def settings(self) -> Settings:
        return Settings(
            payload_path=self.payload_path,
            store_url=self.store_url,
            code_root=self.code_root,
            scratch_dir=self.scratch,
        )

    def run(self, *, environ: dict[str, str] | None = None, **payload: Any) -> Outcome:
        """One attempt in this process (signals not installed), the worker's console to a file."""
        if payload or not self.payload_path.exists():
            self.write_payload(**payload)
        with open(self.root / "stdout.bin", "ab") as out:
            return run_attempt(
                self.settings(),
                {**os.environ, **(environ or {})},
                out_fd=out.fileno(),
                handle_signals=False,
            )

    def cli(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[bytes]:
        """``python -m fsm`` as a real process."""
        return subprocess.run(
            [sys.executable, "-m", "fsm", *args],
            env={**os.environ, **(env or {})},
            capture_output=True,
            timeout=timeout,
            check=False,
        )

    def run_args(self) -> list[str]:
        return [
            "run",
            "--payload",
            str(self.payload_path),
            "--store",
            self.store_url,
            "--code-root",
            str(self.code_root),
            "--scratch-dir",
            str(self.scratch),
        ]

    def artifact(self, name: str) -> Path:
        return self.store / PREFIX / name

    def marker(self, attempt: int = 0, arm: str = ARM) -> dict[str, Any] | None:
        path = self.artifact(f"{arm}_attempt{attempt}.json")
        return json.loads(path.read_text()) if path.exists() else None

    def markers(self) -> list[Path]:
        return (
            sorted(path for path in (self.store / PREFIX).glob("*_attempt*.json")
                   if not path.name.endswith(".lease.json"))  # a lease is no marker
            if (self.store / PREFIX).exists()
            else []
        )


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    lay = Layout(tmp_path)
    for sub in ("store", "scratch", "runcode", "flash"):
        (tmp_path / sub).mkdir()
    return lay


@pytest.fixture
def captured_logs() -> Iterator[list[Any]]:
    with structlog.testing.capture_logs() as logs:
        yield logs


def read_until(stream: IO[bytes] | None, needle: bytes, timeout: float = 30) -> bytes:
    """Read a child's pipe until ``needle`` shows up (bounded); returns what was read."""
    assert stream is not None
    seen = b""
    give_up = time.monotonic() + timeout
    while needle not in seen:
        left = give_up - time.monotonic()
        assert left > 0, f"never saw {needle!r}; got {seen[-800:]!r}"
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, f"the pipe closed before {needle!r}; got {seen[-800:]!r}"
            seen += chunk
    return seen


def assert_no_secret(root: Path, secret: str = CANARY) -> None:
    """The secret is in no file under ``root`` except the payload that carries it."""
    for path in root.rglob("*"):
        if path.is_file() and path.name != "payload.json":
            assert secret.encode() not in path.read_bytes(), f"secret leaked into {path}"


Events = list[MutableMapping[str, Any]]


@pytest.fixture
def events(hub_token: str) -> Iterator[Events]:
    """Every structlog event of the test; none may contain the canary token."""
    with structlog.testing.capture_logs() as captured:
        yield captured
    assert hub_token not in repr(captured)


def make_store(server: LocalHubServer, repo: str, token: str, **kw: Any) -> HubStore:
    """A Hub store on the local server with short retries (``kw`` overrides them)."""
    options: dict[str, Any] = {"call_timeout_s": 5.0, "retry_base_s": 0.01,
                               "retry_max_s": 1.0, "max_attempts": 4}
    options.update(kw)
    deadline = options.pop("deadline", Deadline.after(60))
    return HubStore(repo, token=token, deadline=deadline, endpoint=server.url, **options)


# --- how a secret gets printed (the redaction tests look for every form) -----------------


def _other_quote_style(secret: str) -> str:
    """The inside of ``repr(secret)`` had it been written between the other quotes."""
    written = repr(secret)
    quote_char, other = written[0], "'" if written[0] == '"' else '"'

    def swap(match: re.Match[str]) -> str:
        if match.group(1) is not None:  # an escape pair: unescape the quote, keep the rest
            return quote_char if match.group(1) == "\\" + quote_char else match.group(1)
        return "\\" + other

    return re.sub(r"(\\.)|" + re.escape(other), swap, written[1:-1], flags=re.DOTALL)


def printed_forms(secret: str) -> list[str]:
    """How a secret gets printed: as is, URL-quoted three ways, JSON-escaped (ASCII or not),
    backslash-escaped (both quote styles), whitespace-collapsed. Forms shorter than 4
    characters are left out: values that short are never masked, by design."""
    forms = {
        secret,
        quote(secret, safe=""),
        quote(secret),
        quote_plus(secret),
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
        repr(secret)[1:-1],
        _other_quote_style(secret),
        " ".join(secret.split()),
    }
    return sorted((f for f in forms if len(f) >= 4), key=len)


def hanging_project(root: Path, url: str) -> Path:
    """A source tree whose build backend blocks on ``url`` (so an installer's grandchild hangs)."""
    root.mkdir()
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "hangbackend"\nbackend-path = ["."]\n'
    )
    (root / "hangbackend.py").write_text(
        textwrap.dedent(f"""\
        import urllib.request

        def get_requires_for_build_wheel(config_settings=None):
            urllib.request.urlopen({url!r}, timeout=60).read()
            return []
        """)
    )
    return root


def closed_port() -> int:
    """A local port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def survivors(marker: str, settle_s: float = 2.0) -> list[int]:
    """Live processes whose environment holds ``marker`` (given ``settle_s`` to die)."""
    end = time.monotonic() + settle_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # gone, or not ours
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.05)
