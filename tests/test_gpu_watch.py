"""The GPUs asked while the worker runs and after it died (issues 24 and 36, CONTRACT
section 8), through the real runner with a fake nvidia-smi that answers in the real tool's
documented format (``fsm.testing.nvidia_smi``) and whose host the test changes mid-run.

A GPU out of reach, fewer GPUs, new uncorrectable ECC errors, reported on two looks: the
watch stops the worker (its stacks first) and the attempt ends retriable,
``host-gpu-lost`` or ``host-gpu-unhealthy``. Only what the GPUs say counts: a look that is
slow, hangs or fails as a whole decides nothing, and a fault seen on one look only is
not confirmed. After a worker died, a change the GPUs report makes it
``worker-host-fault``, over a job fault in the console (no answer is no change); the job's
own ``CUDA_VISIBLE_DEVICES`` explaining "No CUDA GPUs are available" keeps it the job's."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CANARY, Layout, read_until

from fsm.host import gpus
from fsm.host.watch import CONFIRM_S, GpuWatch, hidden_by_env
from fsm.testing.nvidia_smi import (
    DRIVER_UNREACHABLE,
    GPU_IS_LOST,
    NVML_UNKNOWN,
    FakeHost,
    FakeNvidiaSmi,
)

WATCH_S = 5.0


@pytest.fixture
def smi(tmp_path: Path) -> Iterator[FakeNvidiaSmi]:
    with FakeNvidiaSmi(tmp_path / "smi", FakeHost.h100s(2)) as fake:
        yield fake


def _env(**extra: str) -> dict[str, str]:
    return {"HF_TOKEN": CANARY, "FLASH_STOP_GRACE_S": "1", "FLASH_STALL_S": "0",
            "FLASH_HOST_WATCH_S": f"{WATCH_S:g}", **extra}


def _start(layout: Layout, smi: FakeNvidiaSmi, **payload: Any) -> subprocess.Popen[bytes]:
    payload.setdefault("env", _env())
    layout.write_payload(**payload)
    return subprocess.Popen([sys.executable, "-m", "fsm", *layout.run_args()],
                            env=smi.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(layout: Layout, proc: subprocess.Popen[bytes], timeout: float = 60) -> dict[str, Any]:
    _, err = proc.communicate(timeout=timeout)
    marker = layout.marker()
    assert marker is not None, err.decode()[-3000:]
    return marker


RUNS = "print('ready', flush=True)\ntime.sleep(60)\n"


def _change_mid_run(layout: Layout, smi: FakeNvidiaSmi, worker: str,
                    change: Callable[[FakeHost], None], **payload: Any) -> dict[str, Any]:
    """Start the runner, wait for the worker's "ready", change the host, and return the
    marker of the attempt."""
    layout.write_worker(worker)
    proc = _start(layout, smi, **payload)
    read_until(proc.stdout, b"ready")
    host = smi.host()
    change(host)
    smi.set(host)
    return _finish(layout, proc)


def test_a_gpu_lost_while_the_worker_runs_stops_it_retriable_naming_the_gpu(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    """NVML loses GPU 1 mid-run: within a watch period the worker is stopped, its stacks
    taken first, and the marker is retriable host-gpu-lost naming GPU 1 and its UUID."""
    layout.write_worker(RUNS)
    proc = _start(layout, smi)
    read_until(proc.stdout, b"ready")
    host = smi.host()
    lost_uuid = host.gpus[1].uuid
    host.gpus[1].unreachable = "Unknown Error"
    smi.set(host)
    changed_at = time.monotonic()
    marker = _finish(layout, proc)
    # a period, two looks a confirmation apart, the stacks
    assert time.monotonic() - changed_at < WATCH_S + CONFIRM_S + 2 + 20 + 10
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, True, "host-gpu-lost")
    assert marker["gpu_watch"]["looks"] >= 2  # seen on two looks
    assert lost_uuid in marker["error"] and "GPU 1" in marker["error"]
    assert marker["worker"]["reason"] == "host"
    assert marker["stacks"]["for"] == "host"
    kinds = {f["kind"] for f in marker["gpu_change"]["findings"]}
    assert kinds == {"unreachable"}


def test_new_uncorrectable_ecc_errors_while_the_worker_runs_are_host_gpu_unhealthy(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    def more_ecc(host: FakeHost) -> None:
        host.gpus[0].ecc_uncorrected = (host.gpus[0].ecc_uncorrected or 0) + 3

    marker = _change_mid_run(layout, smi, RUNS, more_ecc)
    assert (marker["retriable"], marker["rule"]) == (True, "host-gpu-unhealthy")
    assert smi.host().gpus[0].uuid in marker["error"]


#: A worker that trains for a while, then completes.
TRAINS_THEN_COMPLETES = ("print('ready', flush=True)\n"
                         "while not (SCRATCH / 'go').exists():\n    time.sleep(0.02)\n"
                         "complete()\n")


def _silence(kind: str) -> Callable[[FakeHost], None]:
    def change(host: FakeHost) -> None:
        if kind == "hang":
            host.hang = ["*"]
        elif kind == "nvml-unknown":  # the container lost NVML, the training goes on [16]
            host.failure, host.failure_status = NVML_UNKNOWN, 255
        elif kind == "driver-unreachable":
            host.failure, host.failure_status = DRIVER_UNREACHABLE, 9
        else:  # slower than the bound: a look that does not answer
            host.delay = {kind: 8.0}
    return change


def _looks(smi: FakeNvidiaSmi, since: int, count: int, *, ended: bool = False,
           timeout: float = 60) -> None:
    """Wait (a poll with a bound) until ``count`` looks (--query-gpu calls) began after the
    ``since``-th call of the fake, and with ``ended`` until they ended too. The watch takes
    one look at a time: a look that began means the runner judged the one before."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        calls = [e for e in smi._log()[since:] if e["argv"][0].startswith("--query-gpu")]
        if len(calls) >= count and not (ended and any(_alive(e["pid"]) for e in calls)):
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} looks within {timeout}s")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("kind", ["--query-gpu", "--query-remapped-rows",
                                  "--query-compute-apps", "hang", "nvml-unknown",
                                  "driver-unreachable"])
def test_looks_that_are_slow_hang_or_fail_as_a_whole_decide_nothing_and_the_run_completes(
    layout: Layout, smi: FakeNvidiaSmi, kind: str
) -> None:
    """Two looks past their bound (FLASH_GPU_QUERY_S=5), each query kind in turn, or
    nvidia-smi hanging or failing as a whole: the healthy run completes, and the marker
    counts the looks that did not answer."""
    layout.write_worker(TRAINS_THEN_COMPLETES)
    proc = _start(layout, smi, env=_env(FLASH_GPU_QUERY_S="5"))
    read_until(proc.stdout, b"ready")
    since = len(smi._log())
    host = smi.host()
    _silence(kind)(host)
    smi.set(host)
    _looks(smi, since, 3)  # two silent looks judged (and a third begun)
    (layout.scratch / "go").write_text("")
    marker = _finish(layout, proc)
    assert (marker["ok"], marker["rule"]) == (True, "completion-confirmed"), marker
    watched = marker["gpu_watch"]
    assert watched["looks"] >= 2
    if kind in ("--query-gpu", "hang", "nvml-unknown", "driver-unreachable"):
        assert watched["unanswered"] >= 2


@pytest.mark.parametrize("unreachable", ["Unknown Error", GPU_IS_LOST])
def test_a_gpu_missing_on_one_look_only_does_not_stop_the_worker(
    layout: Layout, smi: FakeNvidiaSmi, unreachable: str
) -> None:
    """NVML cannot reach GPU 1 on one look; the next look, a few seconds later, lists it
    again: not confirmed, the run completes."""
    layout.write_worker(TRAINS_THEN_COMPLETES)
    proc = _start(layout, smi)
    read_until(proc.stdout, b"ready")
    since = len(smi._log())
    healthy = smi.host()
    host = smi.host()
    host.gpus[1].unreachable = unreachable
    smi.set(host)
    _looks(smi, since, 1, ended=True)  # one look answered with the GPU out of reach
    smi.set(healthy)                   # well before the second look, CONFIRM_S later
    since = len(smi._log())
    _looks(smi, since, 2)  # the second look (the GPU back) judged, a third begun
    (layout.scratch / "go").write_text("")
    marker = _finish(layout, proc)
    assert (marker["ok"], marker["rule"]) == (True, "completion-confirmed"), marker
    assert marker["gpu_watch"]["looks"] >= 2 and "gpu_change" not in marker




def test_with_the_host_watch_off_a_gpu_lost_mid_run_does_not_stop_the_worker(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    layout.write_worker("print('ready', flush=True)\n"
                        "while not (SCRATCH / 'go').exists():\n    time.sleep(0.02)\n"
                        "time.sleep(7)\ncomplete()\n")
    proc = _start(layout, smi, env=_env(FLASH_HOST_WATCH_S="0"))
    read_until(proc.stdout, b"ready")
    host = smi.host()
    host.gpus[1].unreachable = "Unknown Error"
    smi.set(host)
    (layout.scratch / "go").write_text("")
    marker = _finish(layout, proc)
    assert marker["ok"] is True


def test_a_worker_that_completed_before_its_gpu_was_lost_succeeded(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    def lose_gpu_0(host: FakeHost) -> None:
        host.gpus[0].unreachable = "Unknown Error"

    marker = _change_mid_run(
        layout, smi, "complete()\nprint('ready', flush=True)\ntime.sleep(60)\n", lose_gpu_0)
    assert (marker["ok"], marker["rule"]) == (True, "completion-confirmed")


@pytest.mark.parametrize(("key", "value"), [
    *(("FLASH_HOST_WATCH_S", value) for value in ("soon", "2", "-5")),
    # a bound: at least 5, no "off"
    *(("FLASH_GPU_QUERY_S", value) for value in ("soon", "0", "4", "-5", "nan")),
])
def test_an_unusable_gpu_setting_makes_the_payload_unusable_naming_it(
    layout: Layout, smi: FakeNvidiaSmi, key: str, value: str
) -> None:
    """One line naming the setting, no traceback, and the marker written."""
    layout.write_worker("complete()\n")
    proc = _start(layout, smi, env=_env(**{key: value}))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err.decode()[-3000:]
    assert key in err.decode().strip().splitlines()[-1]
    assert "Traceback" not in err.decode()
    assert layout.marker() is not None  # the destination is known: a marker is written


# --- after the worker died ------------------------------------------------------------------

DIES = """
print("ready", flush=True)
while not (SCRATCH / "go").exists():
    time.sleep(0.02)
print({console!r}, flush=True)
sys.exit(1)
"""


def _dies(layout: Layout, smi: FakeNvidiaSmi, console: str, change: Any,
          **payload: Any) -> dict[str, Any]:
    layout.write_worker(DIES.format(console=console))
    payload.setdefault("env", _env(FLASH_HOST_WATCH_S="0"))
    proc = _start(layout, smi, **payload)
    read_until(proc.stdout, b"ready")
    host = smi.host()
    change(host)
    smi.set(host)
    (layout.scratch / "go").write_text("")
    return _finish(layout, proc)


def _lose_gpu_1(host: FakeHost) -> None:
    host.gpus[1].unreachable = "Unknown Error"


def _ecc_on_gpu_0(host: FakeHost) -> None:
    host.gpus[0].ecc_uncorrected = (host.gpus[0].ecc_uncorrected or 0) + 1


def _nothing(host: FakeHost) -> None:
    return None


def test_a_worker_that_died_silently_after_its_gpu_went_is_a_host_fault(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    """A crash whose console decides nothing: the GPUs asked again say GPU 1 went, so
    the host is at fault, retried on a fresh host, the GPU named."""
    marker = _dies(layout, smi, "Segmentation fault (core dumped)", _lose_gpu_1)
    assert (marker["retriable"], marker["rule"]) == (True, "worker-host-fault")
    assert smi.host().gpus[1].uuid in marker["error"]
    assert marker["gpu_change"]["when"] == "after the worker ended"


def test_when_the_gpus_changed_they_win_over_a_job_fault_in_the_console(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    """CUDA out of memory in the console, but GPU 0 counted new uncorrectable ECC errors:
    the GPUs know better, host fault."""
    marker = _dies(layout, smi, "torch.OutOfMemoryError: CUDA out of memory.", _ecc_on_gpu_0)
    assert (marker["retriable"], marker["rule"]) == (True, "worker-host-fault")


def test_with_unchanged_gpus_a_job_fault_stays_the_jobs(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    marker = _dies(layout, smi, "torch.OutOfMemoryError: CUDA out of memory.", _nothing)
    assert (marker["retriable"], marker["rule"]) == (False, "worker-failed")
    assert "gpu_change" not in marker


def _driver_gone(host: FakeHost) -> None:
    host.failure = DRIVER_UNREACHABLE


@pytest.mark.parametrize(
    ("visible", "change", "rule"),
    [("7", _nothing, "worker-failed"), (None, _nothing, "worker-failed"),
     (None, _driver_gone, "worker-host-fault")],
    ids=["the-jobs-env-hides-every-gpu", "gpus-fine-before-and-after", "driver-gone-after"])
def test_no_cuda_gpus_is_the_hosts_fault_only_when_the_gpus_say_so(
    layout: Layout, smi: FakeNvidiaSmi, visible: str | None, change: Any, rule: str
) -> None:
    """"No CUDA GPUs are available" on a 2-GPU host: with the payload's own
    CUDA_VISIBLE_DEVICES=7 (no such GPU) it is the job's doing, fatal; with nvidia-smi
    listing both GPUs the same before setup and after the death, something inside the job
    hid them (ray-project/ray#37225), fatal; with the driver gone after the death, the
    host's."""
    extra = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    marker = _dies(layout, smi, "RuntimeError: No CUDA GPUs are available", change,
                   env=_env(FLASH_HOST_WATCH_S="0", **extra))
    assert marker["rule"] == rule
    if rule == "worker-failed":
        assert marker["job_fault"]["signature"] == "cuda-no-gpus"


# --- the pieces ------------------------------------------------------------------------------


def test_the_watch_takes_one_snapshot_at_a_time_and_says_the_host_failed_on_a_change(
    smi: FakeNvidiaSmi,
) -> None:
    start = gpus.snapshot(smi.env())
    now = [0.0]
    watch = GpuWatch(start, smi.env(), 30.0, clock=lambda: now[0])
    assert watch.due() == 30.0 and watch.look() is False  # not due yet: nothing asked
    now[0] = 30.0
    assert watch.look() is False  # a snapshot started
    pending = watch._pending
    assert pending is not None and pending.result(5) is not None
    assert watch.look() is False and watch.due() == 60.0  # healthy: next look in 30 s
    host = smi.host()
    host.gpus[0].unreachable = "Unknown Error"
    smi.set(host)
    for at, stops in ((60.0, False), (60.0 + CONFIRM_S, True)):  # seen, then seen again
        now[0] = at
        watch.look()
        assert watch._pending is not None and watch._pending.result(5) is not None
        assert watch.look() is stops
    assert watch.verdict is not None and watch.verdict.kinds() == {"unreachable"}
    assert watch.evidence() == {"looks": 3, "unanswered": 0}


@pytest.mark.parametrize(("visible", "hidden"), [
    ("7", True), ("", True), ("-1", True), ("0", False), ("1,7", False), ("7,0", True),
    ("GPU-nonexistent", True), ("MIG-whatever", False), (None, False),
])
def test_cuda_visible_devices_hides_the_gpus_only_when_it_names_none_the_host_has(
    smi: FakeNvidiaSmi, visible: str | None, hidden: bool
) -> None:
    start = gpus.snapshot(smi.env())
    assert hidden_by_env(start, visible) is hidden
    assert hidden_by_env(start, start.gpus[1].uuid) is False
