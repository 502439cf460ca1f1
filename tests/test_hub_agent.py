"""The agent process that makes the Hub calls (``fsm.hub.agent``), through the real runner.

It is forked at the runner's first instruction and is the runner's child in a session of
its own: the worker finds it as the child of its parent whose session is its own pid.
These tests take it away, or signal the runner's group, and check the marker still lands.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hubrun import HubRun, agent_of

from fsm.host import gpus
from fsm.testing.nvidia_smi import FakeHost, FakeNvidiaSmi

pytestmark = pytest.mark.hub

# The worker's view of the agent: its parent's children in a session of their own.
_FIND_AGENT = """
import signal

def _agents():
    runner, found = os.getppid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == runner and int(fields[3]) == int(entry):
            found.append(int(entry))
    return found
"""


def test_an_agent_killed_mid_attempt_is_replaced_and_the_marker_lands(
    hub_run: HubRun,
) -> None:
    """SIGKILL to the agent while the worker runs (the OOM killer's way): the runner's next
    store calls fail as connection errors, are retried on a new agent, and the attempt
    ends 0 with its marker. The agent holds the token in neither its argv nor its
    environment."""
    hub_run.write_worker(_FIND_AGENT + """
token = os.environ["HF_TOKEN"].encode()
agents = _agents()
for pid in agents:
    with open(f"/proc/{pid}/environ", "rb") as f:
        in_env = token in f.read()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        in_argv = token in f.read()
    print(f"agent token_in_env={in_env} token_in_argv={in_argv}", flush=True)
    os.kill(pid, signal.SIGKILL)
print(f"agents={len(agents)}", flush=True)
complete()
""")
    proc = hub_run.cli()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    console = (hub_run.scratch / "console_sft.txt").read_text()  # the runner's own copy
    assert "agents=1" in console
    assert "agent token_in_env=False token_in_argv=False" in console
    events = [json.loads(line) for line in proc.stderr.decode().splitlines()
              if line.startswith("{")]
    exited = [e for e in events if e["msg"] == "hub.agent_exited"]
    assert [e["status"] for e in exited] == [-signal.SIGKILL]


def test_ctrl_c_to_the_runners_group_leaves_the_agent_to_publish_the_marker(
    hub_run: HubRun, tmp_path: Path,
) -> None:
    """SIGINT to the runner's whole process group (a terminal's Ctrl-C) stops the attempt;
    the agent, in a session of its own, is not reached, and the interrupted attempt's
    retriable marker lands through it."""
    started = tmp_path / "worker-started"
    hub_run.write_worker(_FIND_AGENT + f"""
import time
open({str(started)!r}, "w").write(str(len(_agents())))
time.sleep(60)
""")
    hub_run.write_payload()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsm", "run", "--payload", str(hub_run.payload_path),
         "--store", hub_run.server.url, "--code-root", str(hub_run.code_root),
         "--scratch-dir", str(hub_run.scratch)],
        env=hub_run.environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text()):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.05)
        assert started.read_text() == "1"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    marker = hub_run.marker()
    assert marker is not None, err.decode()[-3000:]
    assert marker["ok"] is False and marker["retriable"] is True, json.dumps(marker)
    assert proc.returncode == 75


def test_the_agents_quiet_settings_are_the_runners() -> None:
    """The agent sets in its own environment what the runner sets in its own
    (``fsm.output.log.QUIET_SETTINGS``): no progress bars on a stderr that becomes events."""
    from fsm.hub import agent
    from fsm.output import log

    assert agent.QUIET_SETTINGS == log.QUIET_SETTINGS


_LOAD = """
import json, sys, warnings
from fsm.hub import library
library.load_library()
from huggingface_hub.utils import yaml_dump
loaded = {name: type(sys.modules.get(name)).__name__ for name in
          ("yaml", "idna", "anyio", "brotli", "chardet", "charset_normalizer")}
dumped = yaml_dump({"model": "é"})  # the stand-in imports yaml and calls the real dump
print(json.dumps({"before": loaded, "dumped": dumped,
                  "after": type(sys.modules["yaml"]).__name__}))
"""


def test_the_agent_loads_the_library_without_what_its_calls_never_use() -> None:
    """``load_library`` (the agent's import) leaves out the modules no call of the
    adapter's uses: YAML stays deferred though the library binds its ``dump`` at import
    (and a dump still works), the optional decoders and encoding guessers are not loaded,
    and requests' warning about a missing guesser never reaches the agent's stderr (the
    runner's events)."""
    proc = subprocess.run([sys.executable, "-W", "always", "-c", _LOAD], capture_output=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stderr == b""
    found = json.loads(proc.stdout)
    assert found["before"] == {"yaml": "Deferred", "idna": "Deferred", "anyio": "NoneType",
                               "brotli": "NoneType", "chardet": "NoneType",
                               "charset_normalizer": "NoneType"}
    assert found["dumped"] == "model: é\n" and found["after"] == "module"


def _fds(pid: int) -> set[str]:
    """What each of ``pid``'s descriptors is (``pipe:[inode]``, a path, ...)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return found


def _queries_of(runner: int, count: int) -> list[int]:
    """The runner's nvidia-smi children, once ``count`` are running (bounded)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read()
            except OSError:
                continue
            if parent == runner and b"nvidia-smi" in argv:
                found.append(int(entry))
        if len(found) >= count:
            return found
        time.sleep(0.02)
    raise AssertionError(f"runner {runner} never had {count} nvidia-smi children")


def test_the_forked_agent_keeps_none_of_the_gpu_queries_pipes(
    hub_run: HubRun, tmp_path: Path
) -> None:
    """The GPUs are asked before the agent is forked (their answer is the longest wait
    before the worker on a big host), and a fork copies every descriptor: the agent
    closes its copies of the queries' pipes, so only the runner reads them and the agent
    holds nothing of a child that is not its own."""
    host = FakeHost.h100s(8)
    host.delay = {"*": 30.0}
    with FakeNvidiaSmi(tmp_path / "smi", host) as smi:
        hub_run.write_worker("complete()")  # reached only after the GPUs' answer
        hub_run.write_payload()
        proc = subprocess.Popen(hub_run.args(), env={**hub_run.environ(), **smi.env()},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        queries: list[int] = []
        try:
            # The queries first: each is a fork of the runner that leads its own session
            # until its exec, which is how the agent looks too. Once every query runs
            # nvidia-smi, the one such child left is the agent.
            queries = _queries_of(proc.pid, len(gpus.QUERIES))
            agent = agent_of(proc.pid)
            pipes = {fd for pid in queries for fd in _fds(pid) if fd.startswith("pipe:")}
            assert pipes <= _fds(proc.pid), "the runner reads every query's output"
            assert pipes & _fds(agent) == set()
        finally:
            proc.kill()
            proc.wait(30)
            for pid in queries:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # each query leads its own session
