"""A bad host is retried elsewhere, the job's own fault is not (issue 13).

The real runner as a process (``python -m fsm run``) runs real worker processes that die
the way training jobs die on a bad GPU host: Python tracebacks of CUDA errors, NCCL's
``DistBackendError``, NVRM Xid lines, a kernel OOM kill. The console's last lines decide
between ``worker-host-fault`` (retriable) and ``worker-failed`` (fatal); ``nvidia-smi``
(a fake one on PATH) says what GPUs the host has, and a host short of the payload's
``expect_gpus`` ends the attempt in LoadPayload, before anything is installed or
downloaded; a kernel OOM kill (the memory cgroup's ``oom_kill`` count) is fatal.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CANARY, TRAIN_PATH, Layout, assert_no_secret

from fsm import policy
from fsm.testing.nvidia_smi import FakeHost, FakeNvidiaSmi

FAMILY = {sig.id: sig.blame for sig in policy.CONSOLE_SIGNATURES}
RETRIABLE = {sig.id: sig.retriable for sig in policy.CONSOLE_SIGNATURES}
#: The runner's own bound on a whole attempt in these tests: far above what any takes.
RUN_TIMEOUT_S = 30

#: What torch appends to every asynchronous CUDA error.
CUDA_HINT = (
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

#: A worker that trains a few steps, then dies of an uncaught CUDA error raised deep in
#: the model (Python prints the whole traceback), without completion artifacts.
CUDA_ERROR_WORKER = """
    MSG = {message!r} + {hint!r}

    def forward(step):
        if step == 3:
            raise RuntimeError(MSG)

    for step in range(5):
        print(f"step {{step}} | loss {{2.5 - step / 10:.4f}} | lr 3.0e-04", flush=True)
        forward(step)
"""


def cuda_error_worker(message: str) -> str:
    return CUDA_ERROR_WORKER.format(message=message, hint=CUDA_HINT)


#: torch.distributed's NCCL failure, as a rank prints it: the exception's qualified name
#: (torch.distributed.DistBackendError), NCCL's own explanation and the socket's error.
NCCL_SYSTEM_ERROR_WORKER = """
    class DistBackendError(RuntimeError):
        pass

    DistBackendError.__module__ = "torch.distributed"
    MSG = (
        "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled "
        "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3\\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed "
        "or device error.\\n"
        "Last error:\\n"
        "socketStartConnect: Connect to 10.0.0.5<43211> failed : Software caused connection "
        "abort"
    )
    print("[rank1]: NCCL INFO Bootstrap : Using eth0:10.0.0.4<0>", flush=True)
    print("[rank1]: NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.0.0.4<0>", flush=True)

    def all_reduce():
        raise DistBackendError(MSG)

    all_reduce()
"""

#: NCCL's warning of a failed InfiniBand completion on stdout, then the launcher gives up.
NCCL_IB_WORKER = """
    print("gpu-node-3:1234:1234 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.0.0.3<0>")
    print("step 1 | loss 2.5000", flush=True)
    print("gpu-node-3:1234:5678 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion "
          "from peer 10.0.0.4<45678> with error 12, opcode 0, len 0, vendor err 129 (Recv)",
          flush=True)
    print("[rank0]: watchdog caught collective operation timeout", file=sys.stderr)
    sys.exit(1)
"""

#: The kernel's NVRM line (a worker tailing dmesg), then what CUDA says after it.
XID_WORKER = """
    print("step 40 | loss 1.9911", flush=True)
    print("[ 8123.441907] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has "
          "fallen off the bus.", file=sys.stderr, flush=True)
    raise RuntimeError("CUDA error: unspecified launch failure")
"""

#: nvidia-smi inside the worker, after a driver upgrade without a reboot.
NVML_WORKER = """
    print("Failed to initialize NVML: Driver/library version mismatch", file=sys.stderr)
    print("NVML library version: 550.54", file=sys.stderr)
    sys.exit(18)
"""

HOST_FAULTS = [
    pytest.param(
        cuda_error_worker("CUDA error: uncorrectable ECC error encountered\n"),
        "gpu", "RuntimeError: CUDA error: uncorrectable ECC error encountered", id="gpu-ecc",
    ),
    pytest.param(
        XID_WORKER, "gpu",
        "[ 8123.441907] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen "
        "off the bus.", id="gpu-xid-79",
    ),
    pytest.param(
        NVML_WORKER, "driver", "Failed to initialize NVML: Driver/library version mismatch",
        id="driver-nvml-mismatch",
    ),
    pytest.param(
        cuda_error_worker("CUDA driver version is insufficient for CUDA runtime version\n"),
        "driver", "RuntimeError: CUDA driver version is insufficient for CUDA runtime version",
        id="driver-too-old",
    ),
    pytest.param(
        NCCL_IB_WORKER, "interconnect",
        "gpu-node-3:1234:5678 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion "
        "from peer 10.0.0.4<45678> with error 12, opcode 0, len 0, vendor err 129 (Recv)",
        id="nccl-net-ib",
    ),
]

TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which 3.75 MiB is free. Including non-PyTorch memory, this process has 79.14 GiB "
    "memory in use. Of the allocated memory 77.80 GiB is allocated by PyTorch, and 512.00 MiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

#: torch's OOM as one rank raises it (``torch.OutOfMemoryError``), uncaught.
OOM_RANK = f"""
import sys
class OutOfMemoryError(RuntimeError):
    pass
OutOfMemoryError.__module__ = "torch"
print("[rank0]: step 12 | loss 2.1000", flush=True)
raise OutOfMemoryError({TORCH_OOM!r})
"""

#: The other rank, once its peer died: NCCL's remote error, alone a host row's words.
NCCL_RANK = """
import sys
print("[rank1]: torch.distributed.DistBackendError: NCCL error in: "
      "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or "
      "there was a network error, NCCL version 2.19.3", file=sys.stderr)
print("[rank1]: ncclRemoteError: A call failed possibly due to a network error or a remote "
      "process exiting prematurely.", file=sys.stderr)
sys.exit(1)
"""

TORCH_OOM_WORKER = f"""
    import subprocess
    subprocess.run([sys.executable, "-c", {OOM_RANK!r}])
    sys.exit(1)
"""

DEVICE_ASSERT_WORKER = """
    for thread in range(3):
        print(f"../aten/src/ATen/native/cuda/Loss.cu:250: nll_loss_forward_reduce_cuda_kernel_2d: "
              f"block: [0,0,0], thread: [{thread},0,0] Assertion `t >= 0 && t < n_classes` failed.",
              file=sys.stderr)
""" + cuda_error_worker("CUDA error: device-side assert triggered\n")

JOB_FAULTS = [
    pytest.param(
        TORCH_OOM_WORKER, "cuda-oom", "torch.OutOfMemoryError: " + TORCH_OOM, id="cuda-oom"
    ),
    pytest.param(
        DEVICE_ASSERT_WORKER, "device-side-assert",
        "RuntimeError: CUDA error: device-side assert triggered", id="device-side-assert",
    ),
    pytest.param(
        cuda_error_worker("CUDA error: an illegal memory access was encountered\n"),
        "illegal-memory-access", "RuntimeError: CUDA error: an illegal memory access was "
        "encountered", id="illegal-memory-access",
    ),
]


@pytest.fixture
def memory_events(tmp_path: Path) -> Path:
    """A memory.events file the runner reads (FLASH_MEMORY_EVENTS): no OOM kill yet."""
    path = tmp_path / "memory.events"
    path.write_text("oom 0\noom_kill 0\n")
    return path


@pytest.fixture
def env(memory_events: Path) -> dict[str, str]:
    """The runner's environment: its OOM count in a file of the test's, whatever this
    machine's cgroup counts meanwhile."""
    return {"FLASH_MEMORY_EVENTS": str(memory_events)}


@pytest.fixture
def fake_pids(tmp_path: Path) -> Iterator[Path]:
    """Where fake nvidia-smis record their pids; whatever still runs at the end is killed."""
    pids = tmp_path / "smi.pids"
    yield pids
    if not pids.exists():
        return
    for pid in {int(p) for p in pids.read_text().split()}:
        with contextlib.suppress(OSError):
            if b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


def fake_smi(tmp_path: Path, script: str) -> dict[str, str]:
    """An executable ``nvidia-smi`` (``script`` is its shell body) first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}


def listing_smi(tmp_path: Path, gpus: int) -> dict[str, str]:
    """A fake nvidia-smi (``fsm.testing.nvidia_smi``: the real tool's query interface and
    formats) on a host of ``gpus`` healthy, idle H100s; its calls are logged."""
    return FakeNvidiaSmi(tmp_path / "smi", FakeHost.h100s(gpus)).env()


def fake_uuids(gpus: int) -> list[str]:
    return [gpu.uuid for gpu in FakeHost.h100s(gpus).gpus]


def _calls(tmp_path: Path) -> list[list[str]]:
    """The argument lists the runner called the fake of ``listing_smi`` with."""
    log = (tmp_path / "smi" / "nvidia-smi-calls.jsonl").read_text().splitlines()
    return [json.loads(line)["argv"] for line in log if line.strip()]


def bare_path() -> str:
    """A PATH with Python and the system's tools, and no nvidia-smi (else the test skips)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("nvidia-smi", path=path) is not None:
        pytest.skip("this machine has a real nvidia-smi in /usr/bin or /bin")
    return path


def run(
    layout: Layout, env: dict[str, str], timeout: float = RUN_TIMEOUT_S
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, Any]]:
    """The runner as a process; its marker, which must exist."""
    proc = layout.cli(*layout.run_args(), env=env, timeout=timeout)
    marker = layout.marker()
    assert marker is not None, proc.stderr.decode("utf-8", "replace")[-3000:]
    return proc, marker


def assert_failed(
    proc: subprocess.CompletedProcess[bytes], marker: dict[str, Any], rule: str,
    *, retriable: bool, state: str = "VerifyRemote",
) -> None:
    stderr = proc.stderr.decode("utf-8", "replace")
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, retriable, rule, state
    ), stderr[-3000:]
    assert proc.returncode == (75 if retriable else 1), stderr[-3000:]  # fsm/exits.py
    last = stderr.strip().splitlines()[-1]
    assert rule in last, last
    assert "Traceback" not in stderr  # the worker's traceback goes to stdout, not the runner's


def console_of(layout: Layout) -> str:
    return layout.artifact("console_sft.txt").read_text()


# --- the console decides: a host's fault is retried ---------------------------------------


@pytest.mark.parametrize(("worker", "family", "line"), HOST_FAULTS)
def test_a_host_fault_on_the_console_is_retriable(
    layout: Layout, env: dict[str, str], worker: str, family: str, line: str
) -> None:
    layout.write_worker(worker)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-host-fault", retriable=True)
    fault = marker["host_fault"]
    assert FAMILY[fault["signature"]] == family
    assert RETRIABLE[fault["signature"]] is True
    assert fault["line"] == line
    assert "job_fault" not in marker
    assert marker["worker"]["exit_code"] != 0
    assert marker["worker"]["oom_killed"] is False
    assert marker["path"] == [*TRAIN_PATH[:-2], "Mark"]
    assert line in console_of(layout)  # the evidence's line is in the stored tail


#: A failing link's own line, before NCCL's system error.
IB_LINK_LINE = ("gpu-node-3:1234:5678 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got "
                "completion from peer 10.0.0.5<43211> with error 12, opcode 0, len 0, vendor "
                "err 129")


@pytest.mark.parametrize("link", [False, True], ids=["alone", "beside-a-link-line"])
def test_ncclsystemerror_alone_is_the_jobs_and_a_link_line_beside_it_is_the_hosts(
    layout: Layout, env: dict[str, str], link: bool
) -> None:
    """NCCL's "unhandled system error" was the job's own NCCL environment in every corpus
    thread that settled it (issue 37): alone it fails the run. A failing link prints its own
    line beside it, which decides: retried."""
    before = f"    print({IB_LINK_LINE!r}, flush=True)\n" if link else ""
    layout.write_worker(before + NCCL_SYSTEM_ERROR_WORKER)
    layout.write_payload()
    proc, marker = run(layout, env)
    if link:
        assert_failed(proc, marker, "worker-host-fault", retriable=True)
        assert marker["host_fault"] == {"signature": "ib-completion-error",
                                        "line": IB_LINK_LINE}
    else:
        assert_failed(proc, marker, "worker-failed", retriable=False)
        assert marker["job_fault"]["signature"] == "nccl-system-error"


def test_the_real_traceback_reaches_the_console_and_its_last_line_decides(
    layout: Layout, env: dict[str, str]
) -> None:
    """The uncaught error prints a whole traceback and torch's hint lines after the error
    line: the line shown is the error line, not the traceback's source lines."""
    layout.write_worker(cuda_error_worker("CUDA error: uncorrectable ECC error encountered\n"))
    layout.write_payload()

    _, marker = run(layout, env)

    console = console_of(layout)
    assert "Traceback (most recent call last):" in console
    assert "in forward" in console and "CUDA_LAUNCH_BLOCKING=1" in console
    assert console.index("uncorrectable ECC") < console.index("CUDA_LAUNCH_BLOCKING")
    assert marker["host_fault"] == {
        "signature": "gpu-ecc-uncorrectable",
        "line": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    }


def test_a_host_fault_line_holding_a_secret_is_shown_redacted(
    layout: Layout, env: dict[str, str]
) -> None:
    """The console is judged redacted: the deciding line, as the marker shows it, holds the
    mask where the worker printed its token."""
    layout.write_worker("""
        raise RuntimeError(
            "No CUDA GPUs are available (CUDA_VISIBLE_DEVICES=0,1; HF_TOKEN="
            + os.environ["HF_TOKEN"] + ")"
        )
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-host-fault", retriable=True)
    fault = marker["host_fault"]
    assert FAMILY[fault["signature"]] == "driver"
    assert fault["line"] == (
        "RuntimeError: No CUDA GPUs are available (CUDA_VISIBLE_DEVICES=0,1; HF_TOKEN=***)"
    )
    assert CANARY.encode() in proc.stdout  # the worker's own output is untouched
    assert CANARY.encode() not in proc.stderr
    assert CANARY not in json.dumps(marker)
    assert_no_secret(layout.root)


# --- the job's own faults stay fatal ------------------------------------------------------


@pytest.mark.parametrize(("worker", "signature", "line"), JOB_FAULTS)
def test_a_job_fault_that_looks_like_a_gpu_failure_is_fatal(
    layout: Layout, env: dict[str, str], worker: str, signature: str, line: str
) -> None:
    layout.write_worker(worker)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-failed", retriable=False)
    assert marker["job_fault"]["signature"] == signature
    assert FAMILY[signature] == "job"
    assert marker["job_fault"]["line"] == line[:300]
    assert "host_fault" not in marker


def test_one_rank_out_of_gpu_memory_and_another_with_nccl_errors_is_the_jobs_fault(
    layout: Layout, env: dict[str, str]
) -> None:
    """Rank 0 runs out of GPU memory; rank 1 then reports NCCL's remote error (a host row's
    words alone), the console's last fault line. The OOM still decides: a fresh host fails
    the same way."""
    layout.write_worker(f"""
        import subprocess
        subprocess.run([sys.executable, "-c", {OOM_RANK!r}])
        subprocess.run([sys.executable, "-c", {NCCL_RANK!r}])
        print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "
              "train.py FAILED", file=sys.stderr)
        sys.exit(1)
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-failed", retriable=False)
    assert marker["job_fault"]["signature"] == "cuda-oom"
    assert "host_fault" not in marker
    console = console_of(layout)
    assert console.index("CUDA out of memory") < console.index("remote process exited")
    after_oom = policy.console_verdict(console.split("CUDA out of memory")[-1])
    assert after_oom is not None and after_oom.signature.retriable  # alone, a host fault


def test_the_workers_retriable_heartbeat_wins_over_a_job_fault_on_its_console(
    layout: Layout, env: dict[str, str]
) -> None:
    layout.write_worker("""
        beat = SCRATCH / "hb.json"
        beat.write_text(json.dumps({"stage": "train", "ts": 1, "attempt": 0, "retriable": True}))
        upload(beat, "heartbeat.json")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-heartbeat-retriable", retriable=True)


def test_a_host_fault_that_scrolled_out_of_the_window_does_not_count(
    layout: Layout, env: dict[str, str]
) -> None:
    layout.write_worker(f"""
        print("RuntimeError: CUDA error: uncorrectable ECC error encountered", flush=True)
        for step in range({policy.CONSOLE_WINDOW_LINES + 5}):
            print(f"step {{step}} | loss 2.5000 | recovered, going on", file=sys.stderr)
        sys.exit(1)
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-failed", retriable=False)
    assert "host_fault" not in marker and "job_fault" not in marker
    assert "uncorrectable ECC error" in console_of(layout)  # it is in the tail, out of window


#: NCCL's start with NCCL_DEBUG=INFO (2.19 and later; 2.18 and earlier print ``dlerror=``).
NCCL_INFO_START = [
    "gpu-node-3:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.3<0>",
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Plugin: Failed to find ncclNetPlugin_v8 symbol.",
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Plugin: Loaded net plugin NCCL RDMA Plugin v7 (v7)",
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Plugin: Failed to find ncclCollNetPlugin_v8 symbol.",
    "gpu-node-3:1234:1234 [0] NCCL INFO cudaDriverVersion 12040",
    "NCCL version 2.19.3+cuda12.3",
    "gpu-node-3:1234:1290 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB "
    "eth0:10.0.0.3<0>",
    "gpu-node-3:1234:1290 [0] NCCL INFO Using network IB",
    "gpu-node-3:1234:1290 [0] NCCL INFO comm 0x55d4c3e0 rank 0 nranks 8 cudaDev 0 busId 18000 "
    "commId 0x7d3f2a1b - Init START",
    "gpu-node-3:1234:1290 [0] NCCL INFO Channel 00/32 :    0   1   2   3   4   5   6   7",
    "gpu-node-3:1234:1290 [0] NCCL INFO comm 0x55d4c3e0 rank 0 nranks 8 cudaDev 0 busId 18000 "
    "commId 0x7d3f2a1b - Init COMPLETE",
]
NCCL_INFO_START_2_18 = [
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Plugin : dlerror=libnccl-net.so: cannot open "
    "shared object file: No such file or directory No plugin found (libnccl-net.so), using "
    "internal implementation",
    *NCCL_INFO_START[5:],
]


@pytest.mark.parametrize(
    "start", [NCCL_INFO_START, NCCL_INFO_START_2_18], ids=["nccl-2.19", "nccl-2.18"]
)
def test_a_job_bug_right_after_a_healthy_nccl_start_is_fatal(
    layout: Layout, env: dict[str, str], start: list[str]
) -> None:
    """With NCCL_DEBUG=INFO (a common recipe setting) a healthy start logs that the net
    plugin lookup "failed"; a bug of the job's right after it must not be retried."""
    layout.write_worker(f"""
        for line in {start!r}:
            print(line, flush=True)

        def compute_loss(batch, target):
            raise ValueError(
                f"Expected input batch_size ({{batch}}) to match target batch_size ({{target}})."
            )

        compute_loss(16, 8)
    """)
    layout.write_payload(env={"HF_TOKEN": CANARY, "NCCL_DEBUG": "INFO"})

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-failed", retriable=False)
    assert "host_fault" not in marker, marker.get("host_fault")


def test_a_worker_that_completes_is_ok_whatever_its_console_says(
    layout: Layout, env: dict[str, str]
) -> None:
    layout.write_worker("""
        print("RuntimeError: CUDA error: uncorrectable ECC error encountered", flush=True)
        complete()
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (
        True, False, "completion-confirmed"
    )
    assert marker["error"] == ""
    assert "host_fault" not in marker


# --- the host's GPUs, by nvidia-smi -------------------------------------------------------


def test_the_marker_names_the_hosts_gpus_and_driver(
    layout: Layout, env: dict[str, str], tmp_path: Path
) -> None:
    """The control plane learns which machine and which GPU faulted, to stop renting it."""
    layout.write_worker(cuda_error_worker("CUDA error: uncorrectable ECC error encountered\n"))
    layout.write_payload(expect_gpus=2)

    proc, marker = run(layout, {**env, **listing_smi(tmp_path, 2)})

    assert_failed(proc, marker, "worker-host-fault", retriable=True)
    assert marker["host"] == {
        "id": ",".join(sorted(fake_uuids(2))),  # the machine, by its GPUs (CONTRACT 9)
        "hostname": socket.gethostname(),
        "gpus": [{"name": "NVIDIA H100 80GB HBM3", "uuid": gpu_uuid, "memory_mib": 81559}
                 for gpu_uuid in fake_uuids(2)],
        "driver": "550.54.15",
    }
    calls = _calls(tmp_path)
    asked = {argv[0].split("=")[0] for argv in calls}
    assert asked == {"--query-gpu", "--query-remapped-rows", "--query-compute-apps"}
    assert all("--format=csv,noheader,nounits" in argv for argv in calls)


def test_a_host_with_at_least_the_expected_gpus_runs_the_worker(
    layout: Layout, env: dict[str, str], tmp_path: Path
) -> None:
    layout.write_worker("complete()")
    layout.write_payload(expect_gpus=8)

    proc, marker = run(layout, {**env, **listing_smi(tmp_path, 8)})

    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert marker["ok"] is True
    assert marker["path"] == TRAIN_PATH[:-1]
    assert len(marker["host"]["gpus"]) == 8


def test_a_driver_warning_on_stderr_does_not_hide_the_gpus(
    layout: Layout, env: dict[str, str], tmp_path: Path
) -> None:
    """nvidia-smi warns on stderr and still answers (exit 0): "WARNING: infoROM is corrupted
    at gpu ..." is an ordinary warning of a working GPU, not a failing nvidia-smi."""
    warning = "WARNING: infoROM is corrupted at gpu 0000:3B:00.0"
    layout.write_worker("complete()")
    layout.write_payload(expect_gpus=2)

    host = FakeHost.h100s(2, warnings=[warning])
    proc, marker = run(layout, {**env, **FakeNvidiaSmi(tmp_path / "smi", host).env()})

    assert proc.returncode == 0, marker["error"]
    assert marker["ok"] is True
    assert [gpu["uuid"] for gpu in marker["host"]["gpus"]] == fake_uuids(2)


#: Where an attempt can end when the GPUs' answer ends it: setup overlaps the answer, and
#: Train waits for it before the worker (CONTRACT section 8).
BEFORE_WORKER = tuple(TRAIN_PATH[: TRAIN_PATH.index("Train") + 1])


def assert_ended_before_worker(layout: Layout, proc: subprocess.CompletedProcess[bytes],
                               marker: dict[str, Any], rule: str) -> None:
    """The GPUs' answer ended the attempt, retriable, before any worker ran."""
    assert marker["state"] in BEFORE_WORKER, marker
    assert_failed(proc, marker, rule, retriable=True, state=marker["state"])
    assert marker["path"][-2:] == [marker["state"], "Mark"]
    assert "worker" not in marker
    assert not (layout.scratch / "worker-ran").exists()
    assert not layout.artifact("console_sft.txt").exists()


def assert_short_host(layout: Layout, proc: subprocess.CompletedProcess[bytes],
                      marker: dict[str, Any]) -> None:
    """A short host: retriable, before any worker ran."""
    assert_ended_before_worker(layout, proc, marker, "host-gpu-missing")
    assert "expect_gpus" in marker["error"]


SENTINEL_WORKER = "(SCRATCH / 'worker-ran').write_text('yes'); complete()"


def test_a_host_short_of_the_expected_gpus_ends_in_load_payload_retriable(
    layout: Layout, env: dict[str, str], tmp_path: Path
) -> None:
    layout.write_worker(SENTINEL_WORKER)
    layout.write_payload(expect_gpus=8)

    proc, marker = run(layout, {**env, **listing_smi(tmp_path, 2)})

    assert_short_host(layout, proc, marker)
    assert "8" in marker["error"] and "2" in marker["error"]
    assert len(marker["host"]["gpus"]) == 2


def test_no_nvidia_smi_with_expect_gpus_is_a_short_host(
    layout: Layout, env: dict[str, str]
) -> None:
    layout.write_worker(SENTINEL_WORKER)
    layout.write_payload(expect_gpus=1)

    proc, marker = run(layout, {**env, "PATH": bare_path()})

    assert_short_host(layout, proc, marker)
    assert "nvidia-smi" in marker["error"]
    # no nvidia-smi, no GPUs to name: the machine by its boot id (CONTRACT section 9)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert marker["host"] == {"id": f"boot:{boot}@{socket.gethostname()}",
                              "hostname": socket.gethostname()}


def test_no_nvidia_smi_without_expect_gpus_runs_and_names_no_host(
    layout: Layout, env: dict[str, str]
) -> None:
    layout.write_worker("complete()")
    layout.write_payload()

    proc, marker = run(layout, {**env, "PATH": bare_path()})

    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert marker["ok"] is True
    assert "host" not in marker


FAILING_SMI = (
    'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver. '
    'Make sure that the latest NVIDIA driver is installed and running."\nexit 9\n'
)


def test_a_failing_nvidia_smi_with_expect_gpus_is_a_short_host(
    layout: Layout, env: dict[str, str], tmp_path: Path
) -> None:
    layout.write_worker(SENTINEL_WORKER)
    layout.write_payload(expect_gpus=1)

    proc, marker = run(layout, {**env, **fake_smi(tmp_path, FAILING_SMI)})

    assert_short_host(layout, proc, marker)
    assert "NVIDIA-SMI has failed" in marker["error"]
    assert "NVIDIA-SMI has failed" in marker["host"]["error"]
    assert marker["host"]["gpus"] == []


def test_a_failing_nvidia_smi_without_expect_gpus_is_only_evidence(
    layout: Layout, env: dict[str, str], tmp_path: Path
) -> None:
    layout.write_worker("complete()")
    layout.write_payload()

    proc, marker = run(layout, {**env, **fake_smi(tmp_path, FAILING_SMI)})

    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert marker["ok"] is True
    assert "NVIDIA-SMI has failed" in marker["host"]["error"]


def hung_smi(pids: Path, how: str) -> str:
    """An nvidia-smi that never answers: ``exec`` sleeps in its own process; ``child`` is a
    wrapper script whose child holds the output pipe open."""
    if how == "exec":
        return f"echo $$ >> {pids}\nexec sleep 60\n"
    return f"echo $$ >> {pids}\nsleep 60 &\necho $! >> {pids}\nwait\n"


@pytest.mark.parametrize("expect_gpus", [None, 1])
@pytest.mark.parametrize("how", ["exec", "child"])
def test_an_nvidia_smi_that_never_answers_is_unresponsive_at_its_bound_and_left_not_running(
    layout: Layout, env: dict[str, str], tmp_path: Path, fake_pids: Path, how: str,
    expect_gpus: int | None,
) -> None:
    """--query-gpu unanswered at FLASH_GPU_QUERY_S (CONTRACT section 8): the driver is not
    answering, retriable host-gpu-unresponsive (expected GPUs or not), no worker, and
    every nvidia-smi the runner started (and its children) killed."""
    layout.write_worker(SENTINEL_WORKER)
    layout.write_payload(expect_gpus=expect_gpus,
                         env={**layout.payload()["env"], "FLASH_GPU_QUERY_S": "5"})

    started = time.monotonic()
    proc, marker = run(layout, {**env, **fake_smi(tmp_path, hung_smi(fake_pids, how))})
    took = time.monotonic() - started

    assert_ended_before_worker(layout, proc, marker, "host-gpu-unresponsive")
    assert "did not answer within 5s (FLASH_GPU_QUERY_S)" in marker["error"], marker["error"]
    assert "did not answer" in marker["host"]["error"]
    assert 5.0 <= took < RUN_TIMEOUT_S
    for pid in {int(p) for p in fake_pids.read_text().split()}:
        assert not _running(pid), f"nvidia-smi (or its child) {pid} still runs"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("value", [0, -1, True, "8", 1.5], ids=repr)
def test_an_invalid_expect_gpus_is_a_payload_error(
    layout: Layout, env: dict[str, str], tmp_path: Path, value: object
) -> None:
    layout.write_worker(SENTINEL_WORKER)
    layout.write_payload(expect_gpus=value)

    proc, marker = run(layout, {**env, **listing_smi(tmp_path, 8)})

    assert proc.returncode == 2, proc.stderr.decode()[-3000:]
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (
        False, False, "payload-invalid"
    )
    assert "expect_gpus" in marker["error"]
    assert not (layout.scratch / "worker-ran").exists()


# --- host RAM: the kernel's OOM killer ----------------------------------------------------


def test_a_worker_the_oom_killer_ended_is_fatal(
    layout: Layout, env: dict[str, str], memory_events: Path
) -> None:
    """The cgroup's oom_kill count rose and the worker died of SIGKILL: host RAM, which a
    fresh host of the same shape runs out of too."""
    layout.write_worker(f"""
        import signal
        print("loading the dataset into RAM", flush=True)
        Path({str(memory_events)!r}).write_text("oom 1\\noom_kill 1\\n")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-oom-killed", retriable=False)
    assert marker["worker"]["oom_killed"] is True
    assert marker["worker"]["signal"] == "SIGKILL"
    assert "host RAM exhausted" in marker["error"]
    assert "not a GPU OOM" in marker["error"]


def test_a_sigkill_without_an_oom_kill_stays_worker_failed(
    layout: Layout, env: dict[str, str]
) -> None:
    layout.write_worker("""
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert_failed(proc, marker, "worker-failed", retriable=False)
    assert marker["worker"]["oom_killed"] is False
    assert marker["worker"]["signal"] == "SIGKILL"
    assert "host RAM" not in marker["error"]


def test_an_oom_kill_does_not_undo_a_completed_attempt(
    layout: Layout, env: dict[str, str], memory_events: Path
) -> None:
    layout.write_worker(f"""
        import signal
        complete()
        Path({str(memory_events)!r}).write_text("oom 1\\noom_kill 1\\n")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    layout.write_payload()

    proc, marker = run(layout, env)

    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert (marker["ok"], marker["rule"]) == (True, "completion-confirmed")


def test_an_unreadable_oom_count_is_no_evidence(layout: Layout, tmp_path: Path) -> None:
    layout.write_worker("""
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    layout.write_payload()

    proc, marker = run(layout, {"FLASH_MEMORY_EVENTS": str(tmp_path / "no-such-file")})

    assert_failed(proc, marker, "worker-failed", retriable=False)
    assert "oom_killed" not in marker["worker"]


# --- a real memory cgroup -----------------------------------------------------------------

CGROUP_FS = Path("/sys/fs/cgroup")
LIMIT_BYTES = 256 << 20


def _own_memory_cgroup() -> tuple[Path, str]:
    """This process's memory cgroup directory and the cgroup version, or skip."""
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        pytest.skip("no /proc/self/cgroup")
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            here = CGROUP_FS / "memory" / rel.lstrip("/")
            if (here / "memory.limit_in_bytes").is_file() and os.access(here, os.W_OK):
                return here, "v1"
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            here = CGROUP_FS / rel.lstrip("/")
            try:
                delegated = "memory" in (here / "cgroup.subtree_control").read_text().split()
            except OSError:
                delegated = False
            if delegated and os.access(here, os.W_OK):
                return here, "v2"
    pytest.skip("no writable memory cgroup (v1 memory not mounted writable, or v2 without "
                "the memory controller delegated to child cgroups)")


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A child memory cgroup limited to 256 MiB (swap included), removed afterwards."""
    parent, version = _own_memory_cgroup()
    child = parent / f"flash-test-{uuid.uuid4().hex[:12]}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc}")
    try:
        if version == "v1":
            (child / "memory.limit_in_bytes").write_text(str(LIMIT_BYTES))
            with contextlib.suppress(OSError):
                (child / "memory.memsw.limit_in_bytes").write_text(str(LIMIT_BYTES))
        else:
            (child / "memory.max").write_text(str(LIMIT_BYTES))
            with contextlib.suppress(OSError):
                (child / "memory.swap.max").write_text("0")
        yield child
    finally:
        give_up = time.monotonic() + 10
        while True:
            try:
                child.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.1)


def test_a_worker_over_a_real_cgroup_memory_limit_is_oom_killed(
    layout: Layout, memory_cgroup: Path
) -> None:
    """No FLASH_MEMORY_EVENTS: the runner finds its own cgroup's count. The worker touches
    1 GiB of host RAM in a 256 MiB cgroup and the kernel kills it."""
    layout.write_worker("""
        print("allocating 1 GiB of host RAM", flush=True)
        block = bytearray(1 << 30)
        for i in range(0, len(block), 4096):
            block[i] = 1
        print("the memory limit did not hold", flush=True)
        complete()
    """)
    layout.write_payload()
    procs = os.fsencode(memory_cgroup / "cgroup.procs")

    def enter_cgroup() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    environ = {k: v for k, v in os.environ.items() if k != "FLASH_MEMORY_EVENTS"}
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", *layout.run_args()],
        env=environ, capture_output=True, timeout=60, check=False, preexec_fn=enter_cgroup,
    )

    marker = layout.marker()
    assert marker is not None, proc.stderr.decode("utf-8", "replace")[-3000:]
    assert_failed(proc, marker, "worker-oom-killed", retriable=False)
    assert marker["worker"]["oom_killed"] is True
    assert marker["worker"]["signal"] == "SIGKILL"
    assert "host RAM exhausted" in marker["error"]
    assert "allocating 1 GiB" in console_of(layout)
    assert (memory_cgroup / "cgroup.procs").read_text().split() == []

