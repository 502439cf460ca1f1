"""Setup overlapped (issue 15): with extras to install, the code and a spilled spec start
downloading when the payload is loaded, under the install; FetchCode and ResolveSpec join
their own. The outcome is the serial one: the earliest failing state's rule decides, and
a failure of an earlier state cancels the downloads.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from conftest import CANARY, PREFIX, TRAIN_PATH, Layout
from hypothesis import given, settings
from hypothesis import strategies as st
from pypi_server import PypiServer, build_wheel

from fsm import table
from fsm.attempt.runner import Outcome, run_attempt
from fsm.context import Settings
from fsm.errors import Interrupted
from fsm.interrupt import InterruptFlag
from fsm.prefetch import Branch
from fsm.testing import LocalHubServer, Network

#: pip must not see this machine's own configuration (find-links, extra indexes).
ISOLATED = {"PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "5",
            "FLASH_PIP_BACKOFF_S": "0.05", "FLASH_INSTALLER": "pip", "HF_TOKEN": CANARY}
WORKER = "complete()"


def _wheel(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return build_wheel(directory, "flashextra", "1.0")


def _env(target: Path) -> dict[str, str]:
    return {**ISOLATED, "PIP_TARGET": str(target)}


def _spill(layout: Layout) -> None:
    spec = layout.store / PREFIX / "job_spec.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"hf_prefix": PREFIX, "spilled": True}))


def _order(logs: list[MutableMapping[str, Any]]) -> list[str]:
    """The log's milestones: code fetched, and each state entered."""
    return [("code.fetched" if e["event"] == "code.fetched" else f"enter {e.get('to')}")
            for e in logs if e["event"] in ("code.fetched", "state.changed")]


def test_the_code_and_the_spilled_spec_download_while_the_extras_install(
    layout: Layout, tmp_path: Path
) -> None:
    wheel = _wheel(tmp_path / "wheels")
    layout.write_worker("(SCRATCH / 'spec_seen.json').write_text(json.dumps(SPEC)); complete()")
    _spill(layout)
    # Every index request answers 0.4 s late: the install takes well over a second.
    with (
        PypiServer([wheel], network=Network(latency_s=0.4)) as index,
        structlog.testing.capture_logs() as logs,
    ):
        outcome = layout.run(extra_pip=["--index-url", index.url, "flashextra"],
                             job_spec_json=None, job_spec_in_hf=True,
                             env=_env(tmp_path / "target"))
    assert outcome.exit_code == 0, outcome.reason
    assert outcome.context.path == TRAIN_PATH
    order = _order(logs)
    # The code was in place before the install ended (before FetchCode was entered).
    assert order.index("code.fetched") < order.index("enter FetchCode"), order
    assert (tmp_path / "target" / "flashextra.py").is_file()
    assert json.loads((layout.scratch / "spec_seen.json").read_text())["spilled"] is True
    assert outcome.context.prefetch == {}  # both joined


def test_without_extras_nothing_is_started_ahead(layout: Layout) -> None:
    layout.write_worker(WORKER)
    with structlog.testing.capture_logs() as logs:
        outcome = layout.run()
    assert outcome.exit_code == 0
    order = _order(logs)
    assert order.index("enter FetchCode") < order.index("code.fetched")


def test_an_install_failure_decides_though_the_code_is_missing_too(
    layout: Layout, tmp_path: Path
) -> None:
    """Both fail: the earlier state's rule decides, as in a serial run."""
    with PypiServer([]) as index:  # the index has no such project: pip fails, fatal
        outcome = layout.run(extra_pip=["--index-url", index.url, "nosuchproject"],
                             env=_env(tmp_path / "target"))
    marker = layout.marker()
    assert marker is not None
    assert (marker["rule"], marker["state"]) == ("pip-failed", "InstallExtras"), marker
    assert outcome.context.path == ["LoadPayload", "InstallExtras", "Mark", "FailedFatal"]


def test_a_download_failure_waits_for_the_install_and_is_decided_in_its_own_state(
    layout: Layout, tmp_path: Path
) -> None:
    """The code is missing (the download fails at once); the install goes on and
    succeeds; FetchCode then raises the download's failure, classified there."""
    wheel = _wheel(tmp_path / "wheels")
    with PypiServer([wheel], network=Network(latency_s=0.2)) as index:
        outcome = layout.run(extra_pip=["--index-url", index.url, "flashextra"],
                             env=_env(tmp_path / "target"))
    marker = layout.marker()
    assert marker is not None
    assert (marker["rule"], marker["state"]) == ("code-missing", "FetchCode"), marker
    assert (tmp_path / "target" / "flashextra.py").is_file()  # the install ran to its end
    assert outcome.context.path[:4] == ["LoadPayload", "InstallExtras", "FetchCode", "Mark"]


def _hub_attempt(hub: LocalHubServer, root: Path, **payload: Any) -> Outcome:
    """One attempt in this process on ``hub`` (a repo holding a worker), its payload's
    keys ``payload``; a deadline watchdog firing fails the test instead of exiting."""
    repo = "org/overlap"
    hub.create_repo(repo)
    hub.add_file(repo, "code/flash/engine/worker/__main__.py", "print('never runs')")
    for sub in ("scratch", "runcode", "flash"):
        (root / sub).mkdir()
    (root / "flash" / "payload.json").write_text(json.dumps(
        {"hf_repo": repo, "hf_prefix": "sft/r/0", "phase": "sft", "seed": 0,
         "job_spec_json": "{}", **payload}))
    settings_ = Settings(payload_path=root / "flash" / "payload.json", store_url=hub.url,
                         code_root=root / "runcode", scratch_dir=root / "scratch")
    exits: list[int] = []
    with open(root / "stdout.bin", "ab") as out:
        outcome = run_attempt(settings_, {**os.environ, "HF_HOME": str(root / "hf")},
                              out_fd=out.fileno(), handle_signals=False,
                              hard_exit=exits.append)
    assert exits == [], "the deadline watchdog fired"
    return outcome


@pytest.mark.hub
def test_a_failed_install_cancels_the_code_download_before_any_file(
    hub_server: LocalHubServer, hub_token: str, tmp_path: Path
) -> None:
    """The code fetch's first request hangs while pip fails: the attempt is marked
    pip-failed at once, and when the hung answer comes, the cancelled branch downloads
    no file."""
    # Long enough that pip has failed (and the branch is cancelled) before the answer comes,
    # even on a loaded machine: pip's three tries take a few seconds.
    hub_server.hang("GET", r"/refs$", seconds=10)
    outcome = _hub_attempt(
        hub_server, tmp_path,
        extra_pip=["--index-url", "http://127.0.0.1:9/", "nosuchproject"],
        env={**_env(tmp_path / "target"), "HF_TOKEN": hub_token, "PIP_TIMEOUT": "1"},
    )
    assert outcome.marker is not None and outcome.marker["state"] == "InstallExtras"
    assert outcome.marker["rule"] == "pip-network"
    branch = outcome.context.prefetch["FetchCode"]
    assert branch.flag.is_set()  # cancelled when InstallExtras failed
    assert branch.done.wait(30), "the cancelled branch never ended"
    assert not [r for r in hub_server.requests if "/resolve/" in r.path and "/code/" in r.path]


def test_a_branch_follows_the_signal_and_hands_its_failure_to_the_joining_state() -> None:
    signal_flag = InterruptFlag()
    flag = signal_flag.follower()
    failing = Branch("f", lambda: (_ for _ in ()).throw(ValueError("broken")), flag)
    with pytest.raises(ValueError, match="broken"):
        failing.join()
    assert Branch("ok", lambda: 42, signal_flag.follower()).join() == 42
    signal_flag.trigger(15)
    assert flag.is_set() and flag.signum == 15
    assert signal_flag.follower().is_set()  # one made after the signal starts set

    def stopped() -> None:
        raise Interrupted(15)

    with pytest.raises(Interrupted):
        Branch("s", stopped, flag).join()


# --- the outcome is the serial one ----------------------------------------------------

EXTRAS = ("ok", "fatal", "network")
CODE = ("ok", "missing")
SPEC = ("inline", "spilled", "spilled-missing")


def _serial(extras: str, code: str, spec: str) -> tuple[str, str]:
    """(rule, state) a serial run reaches: the first failing state in the table's order."""
    if extras == "fatal":
        return "pip-failed", table.INSTALL_EXTRAS
    if extras == "network":
        return "pip-network", table.INSTALL_EXTRAS
    if code == "missing":
        return "code-missing", table.FETCH_CODE
    if spec == "spilled-missing":
        return "spec-fetch", table.RESOLVE_SPEC
    return "completion-confirmed", table.VERIFY_REMOTE


@settings(max_examples=20)
@given(extras=st.sampled_from(EXTRAS), code=st.sampled_from(CODE), spec=st.sampled_from(SPEC))
def test_the_overlapped_outcome_is_the_serial_one(
    tmp_path_factory: pytest.TempPathFactory, extras: str, code: str, spec: str
) -> None:
    root = tmp_path_factory.mktemp("overlap")
    layout = Layout(root)
    for sub in ("store", "scratch", "runcode", "flash"):
        (root / sub).mkdir()
    if code == "ok":
        layout.write_worker(WORKER)
    if spec == "spilled":
        _spill(layout)
    wheel = _wheel(root / "wheels")
    requirement = {"ok": str(wheel), "fatal": str(root / "wheels" / "nosuch-1.0-py3-none-any.whl"),
                   "network": "flashextra"}[extras]
    options = ["--index-url", "http://127.0.0.1:9/"] if extras == "network" else ["--no-index"]
    spill: dict[str, Any] = (
        {} if spec == "inline" else {"job_spec_json": None, "job_spec_in_hf": True}
    )
    layout.run(extra_pip=[*options, requirement], env=_env(root / "target"), **spill)
    marker = layout.marker()
    assert marker is not None
    assert (marker["rule"], marker["state"]) == _serial(extras, code, spec), marker
    assert marker["retriable"] is (marker["rule"] in ("pip-network", "spec-fetch"))


@pytest.mark.hub
def test_the_attempt_deadline_reaches_a_hung_code_download(
    hub_server: LocalHubServer, hub_token: str, tmp_path: Path
) -> None:
    """The code fetch's first request never answers; the install succeeds; FetchCode's
    join ends at the work deadline with the branch's own DeadlineExceeded: rule deadline."""
    hub_server.hang("GET", r"/refs$", seconds=60)
    outcome = _hub_attempt(
        hub_server, tmp_path, max_wall_s=8,
        extra_pip=["--no-index", str(_wheel(tmp_path / "wheels"))],
        env={**_env(tmp_path / "target"), "HF_TOKEN": hub_token,
             "FLASH_EXIT_RESERVE_S": "3", "FLASH_STORE_CALL_TIMEOUT_S": "60"},
    )
    assert outcome.marker is not None
    assert (outcome.marker["rule"], outcome.marker["state"]) == ("deadline", "FetchCode")
    assert (tmp_path / "target" / "flashextra.py").is_file()  # the install had finished
