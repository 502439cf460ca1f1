"""The GPUs asked before the worker starts (issues 24 and 36, CONTRACT section 8), through
the real runner with a fake nvidia-smi that answers in the real tool's query formats
(``fsm.testing.nvidia_smi``).

Setup goes on while they answer. A sick GPU (uncorrectable ECC errors, pages pending
retirement, rows pending remapping, a remapping failure, a GPU NVML cannot reach) ends
the attempt the moment the answer comes, retriable ``host-gpu-unhealthy``; a busy one
(more than 1 GiB held, or a compute process the attempt did not start) retriable
``host-gpu-busy``; and no worker ever starts before the answer. The marker names the GPU's
index and UUID and what it reported. Fields a GPU or a driver does not support are unknown,
never sick; a slow answer is an answer."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PREFIX, REPO, TRAIN_PATH, Layout
from pypi_server import PypiServer, build_wheel

from fsm.testing.nvidia_smi import FakeApp, FakeGpu, FakeHost, FakeNvidiaSmi

SENTINEL_WORKER = "(SCRATCH / 'worker-ran').write_text('yes'); complete()"


@pytest.fixture
def smi(tmp_path: Path) -> Iterator[FakeNvidiaSmi]:
    with FakeNvidiaSmi(tmp_path / "smi", FakeHost.h100s(8)) as fake:
        yield fake


def _run(layout: Layout, smi: FakeNvidiaSmi, **payload: Any
         ) -> tuple[subprocess.CompletedProcess[bytes], dict[str, Any]]:
    layout.write_worker(SENTINEL_WORKER)
    layout.write_payload(**payload)
    proc = layout.cli(*layout.run_args(), env=smi.env(), timeout=30)
    marker = layout.marker()
    assert marker is not None, proc.stderr.decode("utf-8", "replace")[-3000:]
    return proc, marker


#: The states an answer of the GPUs can end the attempt in: setup overlaps it, and Train
#: waits for it before the worker.
BEFORE_WORKER = tuple(TRAIN_PATH[: TRAIN_PATH.index("Train") + 1])


def _assert_ended_before_setup(layout: Layout, marker: dict[str, Any], rule: str) -> None:
    """Ended by the GPUs' answer, retriable, before any worker ran."""
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, True, rule), marker
    assert marker["state"] in BEFORE_WORKER
    assert marker["path"][-2:] == [marker["state"], "Mark"]
    assert "worker" not in marker
    assert not (layout.scratch / "worker-ran").exists()


def _sick(attr: str, value: object) -> Callable[[FakeHost], None]:
    def change(host: FakeHost) -> None:
        setattr(host.gpus[3], attr, value)
    return change


def _old_gpu_with_pages_pending(host: FakeHost) -> None:
    """A V100 (pre-Ampere: retires pages, does not remap rows)."""
    host.gpus[3] = FakeGpu(uuid=host.gpus[3].uuid, bus_id=host.gpus[3].bus_id,
                           name="Tesla V100-SXM2-32GB", memory_total_mib=32768,
                           retired_pages_pending=True, remapped_correctable=None,
                           remapped_uncorrectable=None, remap_pending=None, remap_failure=None)


SICK = [
    pytest.param(_sick("ecc_uncorrected", 2), "ecc.errors.uncorrected.volatile.total",
                 id="ecc-uncorrected"),
    pytest.param(_old_gpu_with_pages_pending, "retired_pages.pending", id="pages-pending"),
    pytest.param(_sick("remap_pending", True), "remapped_rows.pending", id="remap-pending"),
    pytest.param(_sick("remap_failure", True), "remapped_rows.failure", id="remap-failure"),
]


@pytest.mark.parametrize(("change", "field"), SICK)
def test_a_sick_gpu_ends_the_attempt_before_setup_naming_the_gpu(
    layout: Layout, smi: FakeNvidiaSmi, change: Callable[[FakeHost], None], field: str
) -> None:
    host = smi.host()
    change(host)
    smi.set(host)

    proc, marker = _run(layout, smi)

    assert proc.returncode == 75  # retriable (fsm/exits.py)
    _assert_ended_before_setup(layout, marker, "host-gpu-unhealthy")
    uuid = host.gpus[3].uuid
    assert f"GPU 3 ({uuid})" in marker["error"] and field in marker["error"], marker["error"]
    findings = marker["gpu_health"]["findings"]
    assert [(f["index"], f["uuid"]) for f in findings] == [(3, uuid)]
    assert findings[0][field] not in (None, False, 0)
    assert len(marker["host"]["gpus"]) == 8  # the host evidence as ever


def test_a_gpu_nvml_cannot_reach_before_setup_is_unhealthy(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    """nvidia-smi prints "Unable to determine the device handle for GPU ...: Unknown Error"
    for GPU 5 and exits non-zero: the other rows are kept, GPU 5 is named by its bus id."""
    host = smi.host()
    host.gpus[5].unreachable = "Unknown Error"
    smi.set(host)

    _, marker = _run(layout, smi)

    _assert_ended_before_setup(layout, marker, "host-gpu-unhealthy")
    assert "Unable to determine the device handle" in marker["error"]
    assert host.gpus[5].bus_id is not None
    assert host.gpus[5].bus_id.lower() in marker["error"].lower()
    assert [f["kind"] for f in marker["gpu_health"]["findings"]] == ["unreachable"]


def test_a_gpu_holding_memory_before_setup_is_busy(layout: Layout, smi: FakeNvidiaSmi) -> None:
    """The previous tenant's leftover: 30 GB held on GPU 2, no process listed."""
    host = smi.host()
    host.gpus[2].memory_used_mib = 30000
    smi.set(host)

    _, marker = _run(layout, smi)

    _assert_ended_before_setup(layout, marker, "host-gpu-busy")
    assert f"GPU 2 ({host.gpus[2].uuid})" in marker["error"]
    assert "30000 MiB" in marker["error"] and "memory.used" in marker["error"]


def test_a_foreign_compute_process_before_setup_is_busy_however_small(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    host = smi.host()
    host.apps.append(FakeApp(host.gpus[6].uuid, pid=4242, process_name="/usr/bin/python3",
                             used_memory_mib=500))
    smi.set(host)

    _, marker = _run(layout, smi)

    _assert_ended_before_setup(layout, marker, "host-gpu-busy")
    # the three queries answer in any order: a busy verdict from --query-compute-apps
    # that came before --query-gpu's listing names the GPU by its UUID alone
    assert (f"GPU 6 ({host.gpus[6].uuid})" in marker["error"]
            or f"GPU {host.gpus[6].uuid} lists" in marker["error"]), marker["error"]
    assert "pid 4242" in marker["error"] and "--query-compute-apps" in marker["error"]
    assert marker["gpu_health"]["findings"][0]["pid"] == 4242


def test_a_sick_gpu_ends_a_preload_before_the_cache_is_warmed(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    """A preload attempt asks the GPUs too: its models warm while they answer, and its
    verdict waits for theirs, so a sick GPU decides even where the warming failed (the
    model is not in the store): the same marker whichever came first."""
    host = smi.host()
    host.gpus[0].ecc_uncorrected = 1
    smi.set(host)
    mount = layout.root / "mnt"
    mount.mkdir()
    (mount / ".mounted").write_text("")
    layout.write_payload(mode="preload", models=["org/alpha"], phase=None, seed=None,
                         job_spec_json=None, cache_mount_marker=".mounted",
                         env={"HF_HOME": str(mount / "hf")})

    proc = layout.cli(*layout.run_args(), env=smi.env(), timeout=30)
    marker = layout.marker()

    assert marker is not None, proc.stderr.decode()[-3000:]
    assert (marker["rule"], marker["retriable"]) == ("host-gpu-unhealthy", True), marker
    assert marker["state"] in ("LoadPayload", "Preload")


def _not_supported(host: FakeHost) -> None:
    """Every health field unsupported, in each spelling nvidia-smi prints."""
    for gpu, spelling in zip(host.gpus, ["[N/A]", "[Not Supported]", "N/A", "",
                                         "[Unknown Error]", "[N/A]", "[N/A]", "[N/A]"],
                             strict=True):
        for name in ("ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
                     "remapped_rows.pending", "remapped_rows.failure",
                     "remapped_rows.uncorrectable", "memory.used"):
            gpu.spellings[name] = spelling


def _old_driver(host: FakeHost) -> None:
    """A driver that refuses a health field of ``--query-gpu``: asked again without it."""
    host.refuse = ["retired_pages.pending"]


def _idle_but_used(host: FakeHost) -> None:
    """A context's own overhead (under 1 GiB) with no process listed is not busy."""
    for gpu in host.gpus:
        gpu.memory_used_mib = 600


def _healthy_counts(host: FakeHost) -> None:
    """Correctable errors and rows remapped for them are normal wear, not sickness."""
    host.gpus[1].remapped_correctable = 12
    host.gpus[2].ecc_uncorrected_aggregate = 3  # lifetime, not since the driver loaded


HEALTHY = [
    pytest.param(_not_supported, id="fields-not-supported"),
    pytest.param(_old_driver, id="field-refused"),
    pytest.param(_idle_but_used, id="under-a-gib"),
    pytest.param(_healthy_counts, id="correctable-wear"),
]


@pytest.mark.parametrize("change", HEALTHY)
def test_what_is_unknown_or_normal_is_never_sick_and_the_worker_runs(
    layout: Layout, smi: FakeNvidiaSmi, change: Callable[[FakeHost], None]
) -> None:
    host = smi.host()
    change(host)
    smi.set(host)

    proc, marker = _run(layout, smi)

    assert proc.returncode == 0, marker["error"]
    assert marker["ok"] is True and marker["path"] == TRAIN_PATH[:-1]
    assert (layout.scratch / "worker-ran").exists()
    assert "gpu_health" not in marker


def test_a_short_host_is_named_before_a_sick_gpu(layout: Layout, smi: FakeNvidiaSmi) -> None:
    """expect_gpus is checked first: 8 expected, 7 listed (one unreachable)."""
    host = smi.host()
    host.gpus[7].unreachable = "Unknown Error"
    smi.set(host)

    _, marker = _run(layout, smi, expect_gpus=8)

    _assert_ended_before_setup(layout, marker, "host-gpu-missing")


def test_explain_names_the_sick_gpu_of_the_marker(layout: Layout, smi: FakeNvidiaSmi) -> None:
    """The operator's one command: which GPU, by index and UUID, and what it reported."""
    host = smi.host()
    host.gpus[4].remap_failure = True
    smi.set(host)
    _run(layout, smi)

    proc = layout.cli("explain", "--repo", REPO, "--prefix", PREFIX, "--store",
                      layout.store_url, "--attempt", "0", timeout=30)

    assert proc.returncode == 0, proc.stderr.decode()
    shown = proc.stdout.decode()
    assert "gpus before setup" in shown
    assert f"row-remap-failure: GPU 4 {host.gpus[4].uuid}" in shown


# --- a slow answer is an answer; setup overlaps it, the worker waits for it -----------------

STARTED_WORKER = "(SCRATCH / 'worker-ran').write_text(repr(time.time())); complete()"


@pytest.mark.parametrize("delay", [3.0, 30.0])
def test_a_healthy_host_whose_nvidia_smi_is_slow_runs_and_the_worker_waits_for_the_answer(
    layout: Layout, smi: FakeNvidiaSmi, delay: float
) -> None:
    """Every query answers correctly but late (3 s; 30 s, as large hosts without the
    persistence daemon do, under the default 60 s bound): the attempt succeeds, and the
    worker starts only once the GPUs have answered."""
    host = smi.host()
    host.delay = {"*": delay}
    smi.set(host)
    layout.write_worker(STARTED_WORKER)
    layout.write_payload(expect_gpus=8)

    started = time.time()
    proc = layout.cli(*layout.run_args(), env=smi.env(), timeout=delay + 60)
    marker = layout.marker()

    assert marker is not None, proc.stderr.decode()[-3000:]
    assert proc.returncode == 0 and marker["ok"] is True, marker["error"]
    assert float((layout.scratch / "worker-ran").read_text()) - started >= delay
    assert len(marker["host"]["gpus"]) == 8 and "error" not in marker["host"]
    # The log says what the start waited for: nvidia-smi's time, and the part of it left
    # after setup (setup took well under a second of it).
    [settled] = [json.loads(line) for line in proc.stderr.splitlines()
                 if b'"host.gpus_settled"' in line]
    assert settled["seconds"] >= delay and settled["decided"] is True
    assert delay - 2 < settled["waited_s"] <= settled["seconds"]


def test_a_sick_answer_stops_setup_the_moment_it_comes(
    layout: Layout, smi: FakeNvidiaSmi, tmp_path: Path
) -> None:
    """The extras install hangs on its index; the GPUs answer 2 s in that GPU 5 has
    uncorrectable ECC errors: the install is stopped at once (not at pip's timeouts), the
    attempt ends in InstallExtras, host-gpu-unhealthy, and no worker runs."""
    host = smi.host()
    host.gpus[5].ecc_uncorrected = 3
    host.delay = {"*": 2.0}
    smi.set(host)
    (tmp_path / "wheels").mkdir()
    wheel = build_wheel(tmp_path / "wheels", "flashextra", "1.0")
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_TIMEOUT": "60", "PIP_RETRIES": "5",
           "FLASH_INSTALLER": "pip", "PIP_TARGET": str(tmp_path / "target")}
    with PypiServer([wheel], hang_limit_s=120) as index:
        index.mode = "hang"
        layout.write_worker(SENTINEL_WORKER)
        layout.write_payload(extra_pip=["--index-url", index.url, "flashextra"],
                             env={**layout.payload()["env"], **env})
        started = time.monotonic()
        proc = layout.cli(*layout.run_args(), env=smi.env(), timeout=60)
        took = time.monotonic() - started

    marker = layout.marker()
    assert marker is not None, proc.stderr.decode()[-3000:]
    _assert_ended_before_setup(layout, marker, "host-gpu-unhealthy")
    assert marker["state"] == "InstallExtras", marker  # stopped while pip waited
    assert f"GPU 5 ({host.gpus[5].uuid})" in marker["error"]
    assert took < 20, took  # 2 s of nvidia-smi, not pip's 60 s timeout
    assert proc.returncode == 75


def test_a_slow_apps_query_neither_makes_a_gpu_busy_nor_holds_the_worker_past_its_bound(
    layout: Layout, smi: FakeNvidiaSmi
) -> None:
    """--query-compute-apps never answers: unknown, not busy; the worker starts at the
    bound (FLASH_GPU_QUERY_S=5) and the run succeeds, the silence in the evidence only."""
    host = smi.host()
    host.hang = ["--query-compute-apps"]
    smi.set(host)
    layout.write_worker(STARTED_WORKER)
    layout.write_payload(env={**layout.payload()["env"], "FLASH_GPU_QUERY_S": "5"})

    proc = layout.cli(*layout.run_args(), env=smi.env(), timeout=60)
    marker = layout.marker()

    assert marker is not None, proc.stderr.decode()[-3000:]
    assert proc.returncode == 0 and marker["ok"] is True, marker["error"]
    assert "gpu_health" not in marker
    assert json.dumps(marker["host"]).count("error") == 0
