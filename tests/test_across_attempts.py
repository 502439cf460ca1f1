"""Evidence across attempts (issue 37, CONTRACT section 9): a fault that follows the job to
a fresh host is the job's; one that stayed behind was the host's.

Two attempts of one run, each through the real runner process with a real worker, on two
fake hosts: their own payload, scratch and code directories, their own ``nvidia-smi``
(``fsm.testing.nvidia_smi``) answering with other GPU UUIDs, and the one store they share.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CANARY, Layout, read_until

from fsm.testing.nvidia_smi import FakeHost, FakeNvidiaSmi


class Host:
    """A machine: its own directories and GPUs, the store it shares with the others."""

    def __init__(self, root: Path, store: Path | None, uuid_tag: str) -> None:
        self.layout = Layout(root)
        for sub in ("scratch", "runcode", "flash"):
            (root / sub).mkdir(parents=True)
        if store is None:
            (root / "store").mkdir()
        else:
            (root / "store").symlink_to(store, target_is_directory=True)
        gpus = FakeHost.h100s(2)
        for gpu in gpus.gpus:
            gpu.uuid = gpu.uuid.replace("6d2b0c1e", uuid_tag)
        self.smi = FakeNvidiaSmi(root / "smi", gpus)
        self.events = root / "memory.events"
        self.events.write_text("oom 0\noom_kill 0\n")

    @property
    def id(self) -> str:
        return ",".join(sorted(gpu.uuid for gpu in self.smi.host().gpus))

    def attempt(self, worker: str, attempt: int = 0, *, change: Callable[[FakeHost], None]
                | None = None, runner_env: dict[str, str] | None = None,
                **env: str) -> tuple[int, dict[str, Any]]:
        """One attempt of the run on this host: the worker prints ``ready``, waits for the
        go (the GPUs' state is changed first when ``change`` says how), then does what
        ``worker`` says. Returns the exit status and the marker."""
        layout = self.layout
        layout.write_worker(READY + worker)
        layout.write_payload(attempt=attempt, env={
            "HF_TOKEN": CANARY, "FLASH_STOP_GRACE_S": "1", "FLASH_HOST_WATCH_S": "0",
            "FLASH_STALL_S": "0", **env})
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsm", *layout.run_args()],
            env={**self.smi.env(), "FLASH_MEMORY_EVENTS": str(self.events),
                 **(runner_env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            read_until(proc.stdout, b"ready")
            if change is not None:
                host = self.smi.host()
                change(host)
                self.smi.set(host)
            (layout.scratch / "go").write_text("")
            _, err = proc.communicate(timeout=90)
        finally:
            proc.kill()
            proc.wait()
        marker = layout.marker(self._written(attempt, runner_env))
        assert marker is not None, err.decode()[-3000:]
        return proc.returncode, marker

    @staticmethod
    def _written(attempt: int, runner_env: dict[str, str] | None) -> int:
        batch = (runner_env or {}).get("AWS_BATCH_JOB_ATTEMPT")
        return attempt + (int(batch) - 1 if batch else 0)


READY = """
print("ready", flush=True)
while not (SCRATCH / "go").exists():
    time.sleep(0.02)
"""


def dies(text: str) -> str:
    return f"sys.stdout.write({text!r})\nsys.stdout.flush()\nsys.exit(1)\n"


#: One fault, as two hosts print it: other ranks, pids, addresses and figures.
IB_ERROR = ("gpu-node-{n}:{pid}:{tid} [{rank}] transport/net_ib.cc:1295 NCCL WARN NET/IB : "
            "Got completion from peer 10.0.{n}.4<4567{n}> with status=12 opcode=0 len=0 "
            "vendor err 129 (Recv)\n")
ON_A = dies(IB_ERROR.format(n=3, pid=1234, tid=1290, rank=0))
ON_B = dies(IB_ERROR.format(n=7, pid=8812, tid=8870, rank=5))
#: Another fault of the same family (the interconnect), not the same fault.
NVLINK = dies("RuntimeError: CUDA error: uncorrectable NVLink error detected during the "
              "execution\n")


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[Host, Host]]:
    a = Host(tmp_path / "a", None, "aaaaaaaa")
    b = Host(tmp_path / "b", a.layout.store, "bbbbbbbb")
    with a.smi, b.smi:
        yield a, b


def assert_follows_job(status: int, marker: dict[str, Any], before: dict[str, Any],
                       previous_attempt: int) -> None:
    assert (status, marker["retriable"], marker["rule"]) == (1, False, "fault-follows-job")
    assert marker["fault"]["fingerprint"] == before["fault"]["fingerprint"]
    assert marker["fault"]["confirmed_by"] == "console"
    assert f"attempt {previous_attempt} failed the same way on another host" in marker["error"]
    assert marker["previous_attempt"] == {"attempt": previous_attempt,
                                          "host": before["host"]["id"],
                                          "fingerprint": before["fault"]["fingerprint"]}


def test_a_console_fault_on_host_a_then_on_host_b_is_the_jobs(
    hosts: tuple[Host, Host]
) -> None:
    a, b = hosts
    status, first = a.attempt(ON_A, 0)
    assert (status, first["retriable"], first["rule"]) == (75, True, "worker-host-fault")
    assert first["host"]["id"] == a.id
    assert first["fault"] == {
        "rule": "worker-host-fault", "family": "interconnect",
        "fingerprint": first["fault"]["fingerprint"], "confirmed_by": "console"}
    status, second = b.attempt(ON_B, 1)
    assert second["host"]["id"] == b.id != a.id
    assert_follows_job(status, second, first, 0)


#: An error in the GPU stack's words that no row names (NVIDIA/nccl#1726: the job's own
#: topology file, as the thread settled).
UNNAMED = "{rank}: ncclCommInitRank failed with error: NCCL error: internal error\n"


def test_an_unnamed_gpu_stack_error_is_retried_once_and_ended_when_it_follows_the_job(
    hosts: tuple[Host, Host]
) -> None:
    a, b = hosts
    status, first = a.attempt(dies(UNNAMED.format(rank="[rank3]")), 0)
    assert (status, first["retriable"], first["rule"]) == (75, True, "worker-host-fault")
    assert first["fault"]["family"] == "gpu-stack"
    assert first["host_fault"]["signature"] == "gpu-stack-error"
    status, second = b.attempt(dies(UNNAMED.format(rank="[rank6]")), 1)
    assert_follows_job(status, second, first, 0)


def _ecc_on_gpu_0(host: FakeHost) -> None:
    host.gpus[0].ecc_uncorrected = (host.gpus[0].ecc_uncorrected or 0) + 1


def test_the_same_fault_confirmed_by_the_gpus_both_times_stays_retriable(
    hosts: tuple[Host, Host]
) -> None:
    a, b = hosts
    for host, worker, attempt in ((a, ON_A, 0), (b, ON_B, 1)):
        status, marker = host.attempt(worker, attempt, change=_ecc_on_gpu_0)
        assert (status, marker["retriable"], marker["rule"]) == (75, True, "worker-host-fault")
        assert marker["fault"]["confirmed_by"] == "gpus"


def test_the_same_fault_twice_on_the_same_host_stays_retriable(
    hosts: tuple[Host, Host]
) -> None:
    a, _ = hosts
    _, first = a.attempt(ON_A, 0)
    status, second = a.attempt(ON_B, 1)
    assert (status, second["rule"]) == (75, "worker-host-fault")
    assert second["fault"]["fingerprint"] == first["fault"]["fingerprint"]
    assert "previous_attempt" not in second


def _unreadable(a: Host) -> None:
    a.layout.artifact("lambda_attempt0.json").write_bytes(b'{"ok": false, "fault": {"ru')


def _another_run(a: Host) -> None:
    path = a.layout.artifact("lambda_attempt0.json")
    marker = json.loads(path.read_text())
    path.write_text(json.dumps({**marker, "run_id": "run-0"}))


@pytest.mark.parametrize(("before", "edit"), [
    (None, None), (ON_A, _unreadable), (ON_A, _another_run), (NVLINK, None),
], ids=["missing", "unreadable", "another-run", "another-fingerprint"])
def test_no_evidence_from_the_previous_attempt_leaves_the_fault_retriable(
    hosts: tuple[Host, Host], before: str | None, edit: Callable[[Host], None] | None
) -> None:
    a, b = hosts
    if before is not None:
        assert a.attempt(before, 0)[0] == 75
    if edit is not None:
        edit(a)
    status, marker = b.attempt(ON_B, 1)
    assert (status, marker["retriable"], marker["rule"]) == (
        75, True, "worker-host-fault"), marker["error"]
    assert "previous_attempt" not in marker


def test_an_engine_that_reruns_the_same_attempt_on_another_host_reads_its_marker(
    hosts: tuple[Host, Host]
) -> None:
    """A Kubernetes Job's pod runs attempt 0 again on host B: the marker host A left for
    attempt 0 is the previous attempt, and B's marker replaces it."""
    a, b = hosts
    _, first = a.attempt(ON_A, 0)
    status, second = b.attempt(ON_B, 0)
    assert_follows_job(status, second, first, 0)
    assert b.layout.marker(0) == second  # replaced


def test_aws_batchs_attempt_number_moves_the_attempt(hosts: tuple[Host, Host]) -> None:
    """AWS Batch says which try this is: the payload's attempt 0 on its second try is
    attempt 1, and attempt 0 is the one before."""
    a, b = hosts
    _, first = a.attempt(ON_A, 0, runner_env={"AWS_BATCH_JOB_ATTEMPT": "1"})
    assert first["attempt"] == 0
    status, second = b.attempt(ON_B, 0, runner_env={"AWS_BATCH_JOB_ATTEMPT": "2"})
    assert second["attempt"] == 1
    assert_follows_job(status, second, first, 0)
    assert b.layout.marker(0) == first  # attempt 0's marker is left as it was


# --- stalls: the same place is the same line (CONTRACT section 7) ----------------------

STALLS = """
def train_loop(which):
    print("step 1 done", flush=True)
    if which == "forward":
        time.sleep(600)  # the all-reduce in the forward pass
    else:
        time.sleep(600)  # the barrier before the checkpoint
train_loop({which!r})
"""


@pytest.mark.parametrize(("second", "rule", "status"), [
    ("forward", "worker-stalled-again", 1), ("checkpoint", "worker-stalled", 75),
], ids=["same-line", "another-line"])
def test_stalls_follow_the_job_only_on_the_same_line(
    hosts: tuple[Host, Host], second: str, rule: str, status: int
) -> None:
    a, b = hosts
    got, first = a.attempt(STALLS.format(which="forward"), 0, FLASH_STALL_S="5")
    assert (got, first["rule"]) == (75, "worker-stalled"), first["error"]
    assert first["fault"]["family"] == "stall"
    assert first["fault"]["confirmed_by"] == "worker"
    where = first["stall"]["where"]
    assert where.startswith("train_loop (") and ":" in where, where
    got, marker = b.attempt(STALLS.format(which=second), 1, FLASH_STALL_S="5")
    assert (got, marker["rule"]) == (status, rule), marker["error"]
    if rule == "worker-stalled-again":
        assert marker["stall"]["previous"] == {"attempt": 0, "where": where}
        assert "stalled on the same line on another host" in marker["error"]
    else:
        assert marker["stall"]["where"] != where
        assert marker["stall"]["where"].split(":")[0] == where.split(":")[0]


@pytest.mark.parametrize(("value", "retries"), [
    (None, 0), ("1", 0), ("3", 2), (" 2 ", 1), ("0", 0), ("-1", 0), ("two", 0), ("", 0),
    ("1e3", 0), ("99999999", 0),
])
def test_only_a_positive_whole_aws_batch_attempt_moves_the_attempt(
    value: str | None, retries: int
) -> None:
    """What is no try number (absent, zero, negative, not a whole number, absurd) moves
    nothing: a wrong guess would write another attempt's marker."""
    from fsm import payload

    environ = {} if value is None else {"AWS_BATCH_JOB_ATTEMPT": value}
    assert payload.engine_retries(environ) == retries
