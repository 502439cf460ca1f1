"""Logs a machine can parse and a person can follow (issue 17).

With stderr piped, every line the runner writes there is one JSON object, but its last
line (the one-line reason, CONTRACT section 2): on every path, both stores, both hub
lines. Each event carries the attempt's identity; long work reports progress; the last
event says how the attempt ended. On a terminal the same events read as lines, with a live
bar for a long transfer. The library's progress bars are off for the runner only.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import textwrap
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    ARM,
    CANARY,
    PREFIX,
    REPO,
    WORKER_COMPLETION,
    Layout,
    closed_port,
    read_until,
)
from pypi_server import build_wheel

import fsm
from fsm.extras.pip import InstallSteps, read_pip_line
from fsm.output import log
from fsm.output.log import Progress
from fsm.store.hub import configure_transfer
from fsm.testing import LocalHubServer

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

PROJECT_ROOT = Path(fsm.__file__).resolve().parents[1]
SENTINEL = ".cache-mounted"
#: Settings the runner keeps for itself: they must not reach the worker from it.
QUIET = tuple(log.QUIET_SETTINGS)
Event = dict[str, Any]


# --- reading the runner's stderr -----------------------------------------------------------


def parse_stderr(stderr: bytes) -> tuple[list[Event], str]:
    """Every line but the last is one JSON object; the last is the reason (returned)."""
    *lines, reason = stderr.decode("utf-8").splitlines()
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            pytest.fail(f"a stderr line is not JSON: {line[:300]!r}")
        assert isinstance(event, dict), line[:300]
        events.append(event)
    assert reason.startswith("flash-bootstrap: "), reason
    return events, reason


def named(events: list[Event], msg: str) -> list[Event]:
    return [e for e in events if e["msg"] == msg]


def assert_told(events: list[Event], *, end_state: str | None, exit_code: int,
                klass: str | None, rule: str | None, published: bool = True) -> Event:
    """The last event is the outcome: end state, class, rule, marker or why not, seconds
    in each state it passed; every event from the lock on carries the attempt's identity."""
    last = events[-1]
    assert last["msg"] == "attempt.outcome", last
    assert (last["end_state"], last["exit_code"], last.get("class"), last.get("rule")) == (
        end_state, exit_code, klass, rule)
    if published:
        assert (last["repo"], last["marker"]) == (REPO, f"{PREFIX}/{ARM}_attempt0.json")
    else:
        assert last["marker_unpublished"] and "marker" not in last
    states = [e["from"] for e in named(events, "state.changed")]
    assert list(last["seconds"])[: len(states)] == states
    assert all(isinstance(s, float) and s >= 0 for s in last["seconds"].values())
    owned = [i for i, e in enumerate(events) if "attempt" in e]
    assert owned or not published, "no event carries the attempt's identity"
    if owned:
        for event in events[owned[0]:]:
            assert (event["run_id"], event["attempt"]) == ("run-1", 0), event
            assert event["state"], event
    return last


def assert_no_canary(stderr: bytes, secret: str = CANARY) -> None:
    assert secret.encode() not in stderr


# --- the local store: every path -----------------------------------------------------------


def _model(store: Path, repo_id: str, files: dict[str, int]) -> int:
    """A model in the local store: each file ``name`` of ``size`` distinct bytes."""
    root = store / "models" / repo_id
    root.mkdir(parents=True)
    for i, (name, size) in enumerate(files.items()):
        (root / name).write_bytes(bytes([i + 1]) * size)
    (root / "weights.gguf").write_bytes(b"skipped")
    return sum(files.values())


def _preload(layout: Layout, models: list[str], **env: str) -> dict[str, Any]:
    mount = layout.root / "mnt"
    mount.mkdir(exist_ok=True)
    (mount / SENTINEL).write_text("")
    return {"mode": "preload", "models": models, "phase": None, "seed": None,
            "job_spec_json": None, "cache_mount_marker": SENTINEL,
            "env": {"HF_TOKEN": CANARY, "HF_HOME": str(mount / "hf"), **env}}


#: pip installs into a throwaway target, isolated from this machine's configuration.
def _pip_env(layout: Layout) -> dict[str, str]:
    return {"HF_TOKEN": CANARY, "PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0",
            "PIP_TIMEOUT": "5", "FLASH_PIP_BACKOFF_S": "0.05",
            "PIP_TARGET": str(layout.root / "site"), "FLASH_STOP_GRACE_S": "2"}


def _setup(name: str, layout: Layout) -> dict[str, Any]:
    """Lay out scenario ``name``; return its payload's overrides."""
    if name in ("train", "extras", "extras-failed", "extras-network"):
        layout.write_worker("print('training'); complete()")
    if name == "train":
        return {}
    if name == "worker-crash":
        layout.write_worker("print('boom', flush=True); sys.exit(3)")
        return {}
    if name == "upload-lost":
        layout.write_worker("write_metrics()")
        return {}
    if name == "deadline":
        layout.write_worker("print('ready', flush=True); time.sleep(60)")
        return {"max_wall_s": 3}
    if name == "watchdog":  # the code fetch hangs on a FIFO: the deadline watchdog ends it
        layout.write_worker("complete()")
        os.mkfifo(layout.store / "code" / "stuck.fifo")
        return {"max_wall_s": 3}
    if name == "payload-invalid":
        return {"seed": "x"}
    if name == "extras":
        wheel = build_wheel(layout.root, "flashextra", "1.0")
        return {"extra_pip": ["--no-index", str(wheel)], "env": _pip_env(layout)}
    if name == "extras-failed":
        return {"extra_pip": ["--no-index", "flashnothere==1.0"], "env": _pip_env(layout)}
    if name == "extras-network":
        index = f"http://127.0.0.1:{closed_port()}/simple/"
        return {"extra_pip": ["--index-url", index, "flashextra"], "env": _pip_env(layout)}
    if name == "preload":
        _model(layout.store, "org/tiny", {"config.json": 100, "model.safetensors": 50_000})
        return _preload(layout, ["org/tiny"])
    if name == "preload-failed":
        return _preload(layout, ["org/missing"])
    raise AssertionError(name)


# name: (exit status, end state, class, rule)
SCENARIOS: dict[str, tuple[int, str | None, str, str]] = {
    "train": (0, "Succeeded", "succeeded", "completion-confirmed"),
    "worker-crash": (1, "FailedFatal", "fatal", "worker-failed"),
    "upload-lost": (75, "FailedRetriable", "retriable", "worker-upload-lost"),
    "deadline": (124, "FailedFatal", "fatal", "deadline"),
    "watchdog": (124, None, "fatal", "deadline"),  # the machine stays where it hung
    "payload-invalid": (2, "FailedFatal", "fatal", "payload-invalid"),
    "extras": (0, "Succeeded", "succeeded", "completion-confirmed"),
    "extras-failed": (1, "FailedFatal", "fatal", "pip-failed"),
    "extras-network": (75, "FailedRetriable", "retriable", "pip-network"),
    "preload": (0, "Succeeded", "succeeded", "completion-confirmed"),
    "preload-failed": (1, "FailedFatal", "fatal", "preload-model-failed"),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_stderr_line_but_the_reason_is_one_json_object(layout: Layout, name: str) -> None:
    """Each path and failure class, stderr piped: JSON lines, the identity on each, the
    outcome last, the reason after it; no secret anywhere in them."""
    code, end_state, klass, rule = SCENARIOS[name]
    layout.write_payload(**_setup(name, layout))
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == code, proc.stderr.decode()[-3000:]
    events, reason = parse_stderr(proc.stderr)
    assert_told(events, end_state=end_state, exit_code=code, klass=klass, rule=rule)
    assert events[-1]["reason"] == reason.removeprefix("flash-bootstrap: ")
    assert_no_canary(proc.stderr)
    if name.startswith("extras"):  # the installer's output is summarised, not passed on
        ends = [e for e in named(events, "extras.progress") if e["report"] == "end"]
        assert len(ends) == 1 and ends[0]["installer"] == "pip"
        assert ends[0]["ok"] is (name == "extras")
        assert b"pip" not in proc.stdout.lower()
        kept = (layout.scratch / "extras_install.log").read_text()
        assert "--- flash-bootstrap: pip install, try 1 of 3 ---" in kept
    if name == "extras":
        assert (ends[0]["phase"], ends[0]["installed"]) == ("installed", 1)
        assert "Successfully installed flashextra-1.0" in kept


def test_a_signal_ends_in_json_lines_and_the_outcome_says_interrupted(layout: Layout) -> None:
    """SIGTERM while the worker runs: the worker's report ends not ok, the outcome last."""
    layout.write_worker("print('ready', flush=True); time.sleep(60)")
    layout.write_payload()
    proc = subprocess.Popen([sys.executable, "-m", "fsm", *layout.run_args()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_until(proc.stdout, b"ready")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err.decode()[-3000:]
    events, _reason = parse_stderr(err)
    assert_told(events, end_state="FailedRetriable", exit_code=75, klass="retriable",
                rule="interrupted")
    worker = [e for e in named(events, "worker.progress") if e["report"] == "end"]
    assert worker[0]["reason"] == "interrupted" and worker[0]["ok"] is False


def test_an_outcome_without_a_destination_says_why_no_marker(layout: Layout) -> None:
    """No usable destination: no marker anywhere, and the last event says why."""
    layout.write_payload(hf_repo=None)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    events, reason = parse_stderr(proc.stderr)
    last = assert_told(events, end_state="FailedFatal", exit_code=2, klass="fatal",
                       rule="payload-invalid", published=False)
    assert "no marker" in reason and last["marker_unpublished"]


def test_the_worker_reports_its_console_and_the_time_left(layout: Layout) -> None:
    """worker.progress counts the console's bytes (what reached stdout) and the time left."""
    layout.write_worker("print('x' * 999); complete()")
    layout.write_payload(max_wall_s=600)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    events, _ = parse_stderr(proc.stderr)
    reports = named(events, "worker.progress")
    assert (reports[0]["report"], reports[-1]["report"]) == ("start", "end")
    end = reports[-1]
    assert end["bytes_done"] == 1000 == len(proc.stdout)
    assert 0 < end["seconds_left"] <= 600
    assert (end["state"], end["ok"], end["reason"]) == ("Train", True, "exited")


# --- progress bars stay the runner's: the worker's environment is the payload's ----------


ENV_WORKER = """
(SCRATCH / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in %r}))
complete()
"""


@pytest.mark.parametrize("payload_sets", [False, True])
def test_the_runners_quiet_settings_do_not_reach_the_worker(
    layout: Layout, payload_sets: bool
) -> None:
    layout.write_worker(ENV_WORKER % (QUIET,))
    env = {"HF_TOKEN": CANARY, **({"HF_HUB_DISABLE_PROGRESS_BARS": "0"} if payload_sets else {})}
    layout.write_payload(env=env)
    runner_env = {k: v for k, v in os.environ.items() if k not in QUIET}
    proc = subprocess.run([sys.executable, "-m", "fsm", *layout.run_args()], env=runner_env,
                          capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    seen = json.loads((layout.scratch / "env.json").read_text())
    expected = dict.fromkeys(QUIET)
    if payload_sets:
        expected["HF_HUB_DISABLE_PROGRESS_BARS"] = "0"
    assert seen == expected


def test_what_a_library_writes_to_stderr_becomes_events_and_the_reason_stays_last() -> None:
    """A progress bar redrawn with carriage returns, a warning, a half-written line: each
    an event, none glued to a JSON line; after silence() the reason passes through."""
    code = textwrap.dedent("""
        import sys, warnings
        from fsm.output import log
        log.configure(sys.stderr, json=True)
        log.quiet_libraries({})
        sys.stderr.write("Fetching 5 files:   0%|   | 0/5\\rFetching 5 files: 100%|###| 5/5")
        sys.stderr.write("\\n")
        warnings.warn("a library warns")
        sys.stderr.write("half a line")
        log.silence()
        print("flash-bootstrap: the reason", file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30,
                          check=True)
    events, reason = parse_stderr(proc.stderr)
    assert reason == "flash-bootstrap: the reason"
    texts = [e["text"] for e in named(events, "library.stderr")]
    assert texts[0] == "Fetching 5 files: 100%|###| 5/5"
    assert any("UserWarning: a library warns" in t for t in texts)
    assert texts[-1] == "half a line"


# --- preload progress adds up to what the cache holds ----------------------------------------


def _blobs(cache: Path, repo_id: str) -> int:
    blobs = cache / ("models--" + repo_id.replace("/", "--")) / "blobs"
    return sum(p.stat().st_size for p in blobs.iterdir())


def _assert_adds_up(events: list[Event], cache: Path, models: dict[str, int]) -> None:
    for repo_id, size in models.items():
        reports = [e for e in named(events, "preload.progress") if e["model"] == repo_id]
        start, end = reports[0], reports[-1]
        assert (start["report"], start["bytes_done"], start["bytes_total"]) == ("start", 0, size)
        assert end["report"] == "end" and end["ok"] is True
        assert end["bytes_done"] == end["bytes_total"] == size == _blobs(cache, repo_id)
        assert end["files_done"] == end["files_total"] == 3
        assert all(e["state"] == "Preload" for e in reports)


def test_preload_progress_adds_up_to_the_bytes_the_cache_holds_local_store(
    layout: Layout,
) -> None:
    sizes = {"config.json": 300, "model-1.safetensors": 2_000_000, "model-2.safetensors": 999}
    models = {repo: _model(layout.store, repo, sizes) for repo in ("org/a", "org/b")}
    layout.write_payload(**_preload(layout, list(models)))
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    events, _ = parse_stderr(proc.stderr)
    _assert_adds_up(events, layout.root / "mnt" / "hf" / "hub", models)


# --- the Hub store, both hub lines (CI runs these again on the 0.x line) ---------------------

HUB_WORKER = """
import json, os, sys, time
from pathlib import Path
from huggingface_hub import HfApi

SPEC = json.loads(os.environ["FLASH_JOB_SPEC_JSON"])
SCRATCH = Path(os.environ["FLASH_SCRATCH_DIR"])
API = HfApi(endpoint=os.environ["HF_ENDPOINT"], token=os.environ["HF_TOKEN"])


def upload(local, name):
    API.upload_file(path_or_fileobj=str(local), path_in_repo=f"{SPEC['hf_prefix']}/{name}",
                    repo_id=SPEC["hf_repo"], repo_type="dataset")
""" + WORKER_COMPLETION


class HubLayout(Layout):
    """A run on the local Hub server, the runner started as a process."""

    server: LocalHubServer
    token: str

    def write_worker(self, body: str) -> None:
        self.server.add_file(REPO, "code/flash/engine/worker/__main__.py",
                             HUB_WORKER + "\n" + textwrap.dedent(body))

    def payload(self, **overrides: Any) -> dict[str, Any]:
        payload = super().payload(**overrides)
        payload["job_spec_json"] = payload.get("job_spec_json") and json.dumps(
            {"hf_repo": REPO, "hf_prefix": PREFIX})
        payload["env"] = {k: (self.token if v == CANARY else v)
                          for k, v in payload.get("env", {}).items()}
        return {k: v for k, v in payload.items() if v is not None}

    def run_args(self) -> list[str]:
        return ["run", "--payload", str(self.payload_path), "--store", self.server.url,
                "--code-root", str(self.code_root), "--scratch-dir", str(self.scratch)]

    def environ(self) -> dict[str, str]:
        path = [str(PROJECT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        return {**os.environ, "HF_HOME": str(self.root / "hf-home"),
                "HF_HUB_DISABLE_TELEMETRY": "1", "FLASH_STORE_RETRY_BASE_S": "0.05",
                "FLASH_STORE_MAX_ATTEMPTS": "2", "PYTHONPATH": os.pathsep.join(path)}

    def cli(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "fsm", *args],
                              env={**self.environ(), **(env or {})}, capture_output=True,
                              timeout=timeout, check=False)

    def marker(self, attempt: int = 0, arm: str = ARM) -> dict[str, Any] | None:
        path = self.server.repo_dir(REPO) / PREFIX / f"{arm}_attempt{attempt}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def add_model(self, repo_id: str, files: dict[str, int]) -> int:
        for i, (name, size) in enumerate(files.items()):
            self.server.add_file(repo_id, name, bytes([i + 1]) * size, "model")
        self.server.add_file(repo_id, "original/consolidated.pth", b"skipped", "model")
        return sum(files.values())


@pytest.fixture
def hub(layout: Layout, hub_server: LocalHubServer, hub_token: str) -> HubLayout:
    run = HubLayout(layout.root)
    run.server, run.token = hub_server, hub_token
    (run.root / "hf-home").mkdir()
    hub_server.create_repo(REPO)
    return run


HUB_SCENARIOS: dict[str, tuple[str, int, str, str, str]] = {
    # name: (worker, exit status, end state, class, rule)
    "train": ("complete()", 0, "Succeeded", "succeeded", "completion-confirmed"),
    "worker-crash": ("sys.exit(3)", 1, "FailedFatal", "fatal", "worker-failed"),
    "store-unavailable": ("complete()", 75, "FailedRetriable", "retriable", "store-unavailable"),
}


@pytest.mark.hub
@pytest.mark.parametrize("name", list(HUB_SCENARIOS))
def test_every_stderr_line_is_json_on_the_hub_store_too(hub: HubLayout, name: str) -> None:
    worker, code, end_state, klass, rule = HUB_SCENARIOS[name]
    hub.write_worker(worker)
    if name == "store-unavailable":
        hub.server.fail("GET", r"/resolve/[^/]+/code/", status=503, times=100)
    hub.write_payload()
    proc = hub.cli(*hub.run_args())
    assert proc.returncode == code, proc.stderr.decode()[-3000:]
    events, _ = parse_stderr(proc.stderr)
    assert_told(events, end_state=end_state, exit_code=code, klass=klass, rule=rule)
    assert_no_canary(proc.stderr, hub.token)


@pytest.mark.hub
def test_an_unpublished_marker_is_in_the_last_event_with_where_the_result_is_kept(
    hub: HubLayout,
) -> None:
    """The store refuses the marker's commit for good (exit 78): the last event says so,
    and where the result is kept."""
    hub.write_worker("sys.exit(3)")
    hub.server.fail("POST", r"/commit/", status=403, times=100)  # the marker cannot land
    hub.write_payload()
    proc = hub.cli(*hub.run_args())
    assert proc.returncode == 78, proc.stderr.decode()[-3000:]
    events, reason = parse_stderr(proc.stderr)
    last = assert_told(events, end_state="FailedFatal", exit_code=78, klass="fatal",
                       rule="worker-failed", published=False)
    assert "403" in last["marker_unpublished"] and "marker NOT published" in reason
    assert Path(last["persisted"]).is_file()


@pytest.mark.hub
def test_hub_preload_progress_adds_up_to_the_bytes_the_cache_holds(hub: HubLayout) -> None:
    """A few MB in three files per model, from the local Hub server through the real client:
    the library's bars are off, and the events count what landed in the cache."""
    sizes = {"config.json": 300, "model-1.safetensors": 3_000_000, "model-2.safetensors": 999}
    models = {repo: hub.add_model(repo, sizes) for repo in ("org/a", "org/b")}
    hub.write_payload(**_preload(hub, list(models)))
    proc = hub.cli(*hub.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    events, _ = parse_stderr(proc.stderr)
    assert_told(events, end_state="Succeeded", exit_code=0, klass="succeeded",
                rule="completion-confirmed")
    _assert_adds_up(events, hub.root / "mnt" / "hf" / "hub", models)
    assert b"Fetching" not in proc.stderr
    assert_no_canary(proc.stderr, hub.token)


# --- a person at a terminal ------------------------------------------------------------------


def _on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``python -m fsm`` with its stderr on a pseudo-terminal (120 columns); return
    its exit status and everything it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "fsm", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    return proc.wait(timeout=60), seen.decode("utf-8", "replace")


@pytest.mark.hub
def test_on_a_terminal_events_read_as_lines_and_a_transfer_draws_a_live_bar(
    hub: HubLayout,
) -> None:
    size = hub.add_model("org/slow", {"config.json": 100, "model.safetensors": 4_000_000,
                                      "tokenizer.json": 100})
    hub.server.set_network(bandwidth_bps=2_000_000)  # about two seconds of transfer
    hub.write_payload(**_preload(hub, ["org/slow"]))
    code, screen = _on_a_terminal(hub.run_args(), {**hub.environ()})
    assert code == 0, screen[-3000:]
    lines = screen.replace("\r\n", "\n").split("\n")
    assert not [line for line in lines if line.lstrip("\r\x1b[K").startswith("{")]
    assert any("[LoadPayload] state.changed  LoadPayload --preload_requested--> Preload" in line
               for line in lines)
    assert any(f"preload.progress end  3/3 files, {size / 1e6:.1f} MB of {size / 1e6:.1f} MB "
               "(100%)" in line for line in lines), screen[-3000:]
    bars = [b for b in screen.split("\r\x1b[K") if b.startswith("preload org/slow [")]
    assert bars, "no live bar was drawn"
    assert all(len(bar.split("\n")[0]) < 120 for bar in bars)
    assert lines[-2] == "flash-bootstrap: attempt 0 succeeded"  # its own line, last


def test_flash_log_format_forces_json_on_a_terminal_and_lines_on_a_pipe(layout: Layout) -> None:
    layout.write_worker("complete()")
    layout.write_payload()
    env = {**os.environ, log.FORMAT_SETTING: "json"}
    code, screen = _on_a_terminal(layout.run_args(), env)
    assert code == 0
    events, _ = parse_stderr(screen.replace("\r\n", "\n").encode())
    assert events[-1]["msg"] == "attempt.outcome"

    proc = layout.cli(*layout.run_args(), env={log.FORMAT_SETTING: "console"})
    assert proc.returncode == 0  # the same attempt again: its result is replayed
    text = proc.stderr.decode()
    assert not [line for line in text.splitlines() if line.startswith("{")]
    assert "\x1b" not in text  # no bar on a pipe
    assert "[Succeeded] attempt.outcome  end_state=Succeeded" in text


# --- the Progress reporter -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_reports_at_start_at_most_every_interval_and_at_the_end(
    captured_logs: list[MutableMapping[str, Any]],
) -> None:
    clock = Clock()
    progress = Progress("fetch", total_files=4, total_bytes=4000, every_s=10, clock=clock,
                        folder="code")
    for _ in range(4):
        clock.now += 4
        progress.advance(files=1, bytes=1000)
    progress.done()
    progress.advance(files=1)  # after the end: nothing more
    reports = [e for e in captured_logs if e["event"] == "fetch.progress"]
    assert [(e["report"], e["files_done"], e["bytes_done"], e["seconds"]) for e in reports] == [
        ("start", 0, 0, 0.0), ("update", 3, 3000, 12.0), ("end", 4, 4000, 16.0)]
    assert reports[-1]["bytes_per_s"] == 250 and reports[-1]["ok"] is True
    assert all(e["folder"] == "code" and e["files_total"] == 4 for e in reports)


def test_progress_watch_measures_at_the_end_and_a_raising_block_ends_not_ok(
    captured_logs: list[MutableMapping[str, Any]],
) -> None:
    measured = iter([{"bytes": 10}, {"bytes": 25, "phase": "installing"}])

    def work() -> None:
        with Progress("extras", every_s=3600) as progress:
            with progress.watch(lambda: next(measured), poll_s=3600):
                pass  # the work; the block's end is measured once
            raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError):
        work()
    end = [e for e in captured_logs if e["event"] == "extras.progress"][-1]
    assert (end["report"], end["bytes_done"], end["ok"]) == ("end", 10, False)


def test_pips_console_reads_as_phases_and_counts() -> None:
    steps = InstallSteps()
    seen = []
    for line in ("Looking in indexes: http://127.0.0.1:1/simple/",
                 "Collecting flashextra==1.0", "  Downloading flashextra-1.0-py3-none-any.whl",
                 "Collecting flashother", "  Using cached flashother-2.0-py3-none-any.whl",
                 "Installing collected packages: flashother, flashextra",
                 "Successfully installed flashextra-1.0 flashother-2.0"):
        read_pip_line(line, steps)
        seen.append(steps.phase)
    assert seen == ["resolving", "resolving", "downloading", "resolving", "downloading",
                    "installing", "installed"]
    assert steps.fields() == {"phase": "installed", "resolved": 2, "downloaded": 2,
                              "installed": 2}
