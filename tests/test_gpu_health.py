"""What the GPUs say about themselves (issue 24, CONTRACT section 8): ``fsm.host.gpus`` reads
nvidia-smi's selective queries as the real tool prints them, bounds the three invocations
together, and draws the verdicts (unhealthy, busy, changed) from snapshots.

Parsing is checked against text as real nvidia-smis printed it (the sources are cited in
``fsm.testing.nvidia_smi``); the fake is checked against the same text; the verdicts are
properties over generated host states, rendered by the fake and read back by the parser.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm.host import gpus
from fsm.host import queries as gpu_queries
from fsm.host.gpus import Answer, Snapshot
from fsm.host.probe import FACTS_WAIT_S, HostProbe, facts_of
from fsm.testing.nvidia_smi import (
    DRIVER_UNREACHABLE,
    GPU_IS_LOST,
    NVML_MISMATCH,
    NVML_UNKNOWN,
    FakeApp,
    FakeHost,
    FakeNvidiaSmi,
    render,
)
from fsm.worker import bounded

#: One H100 row, in GPU_FIELDS order, with the values the H100 capture printed for them
#: (utkuozdemir/nvidia_gpu_exporter, internal/captures/...h100-80gb-hbm3__590.48.01.txt).
H100_ROW = ("0, GPU-00000000-0000-0000-0000-000000000000, 00000000:00:09.0, 81559, 0, "
            "590.48.01, 0, [N/A], NVIDIA H100 80GB HBM3")
UUID = "GPU-00000000-0000-0000-0000-000000000000"
#: What nvidia-smi prints instead of a value (fsm.testing.nvidia_smi [2], [13]).
UNKNOWN_SPELLINGS = ["[N/A]", "N/A", "[Not Supported]", "", "[Unknown Error]",
                     "[Insufficient Permissions]", "[Requested functionality has been deprecated]"]


def row(i: int, *, uuid: str | None = None, bus: str | None = None, used: str = "0",
        ecc: str = "0", retired: str = "[N/A]", name: str = "NVIDIA H100 80GB HBM3") -> str:
    uuid = uuid or f"GPU-6d2b0c1e-0000-4000-8000-{i:012x}"
    bus = bus or f"00000000:{0x18 + 0x10 * i:02X}:00.0"
    return f"{i}, {uuid}, {bus}, 81559, {used}, 550.54.15, {ecc}, {retired}, {name}"


def remap_row(i: int, *, pending: str = "No", failure: str = "No", unc: str = "0") -> str:
    return (f"GPU-6d2b0c1e-0000-4000-8000-{i:012x}, 00000000:{0x18 + 0x10 * i:02X}:00.0, "
            f"0, {unc}, {pending}, {failure}")


def parse(gpu: str = "", remap: str | None = "", apps: str | None = "", *, status: int = 0,
          stderr: str = "") -> Snapshot:
    """A snapshot from literal outputs: every query exits ``status``, with ``stderr``."""
    answers = {"gpu": Answer(gpu, stderr, status)}
    if remap is not None:
        answers["remapped-rows"] = Answer(remap, stderr, status)
    if apps is not None:
        answers["compute-apps"] = Answer(apps, stderr, status)
    return gpus.parse_snapshot(answers)


def snap_of(host: FakeHost) -> Snapshot:
    """The snapshot of ``host``, as the fake renders it and the parser reads it back (no
    process involved)."""
    answers = {}
    for name, args in gpus.QUERIES.items():
        out = render(host, args)
        answers[name] = (Answer(status=None, hung=True) if out.hang
                         else Answer(out.stdout, out.stderr, out.status))
    return gpus.parse_snapshot(answers)


def bare_path() -> str:
    """A PATH with Python and the system's tools, and no nvidia-smi (else the test skips)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("nvidia-smi", path=path) is not None:
        pytest.skip("this machine has a real nvidia-smi in /usr/bin or /bin")
    return path


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeNvidiaSmi]:
    """A fake nvidia-smi on 8 healthy, idle H100s; hung calls are killed afterwards."""
    with FakeNvidiaSmi(tmp_path / "smi", FakeHost.h100s(8)) as smi:
        yield smi


# --- parsing what real nvidia-smis print ---------------------------------------------------


def test_an_h100_row_as_nvidia_smi_prints_it_is_read_field_by_field() -> None:
    """Index, UUID, bus id, memory, driver, ECC count, name: and [N/A] as unknown."""
    snap = parse(H100_ROW, f"{UUID}, 00000000:00:09.0, 0, 0, No, No\n")

    assert snap.problem is None and snap.listed
    (gpu,) = snap.gpus
    assert (gpu.index, gpu.uuid, gpu.bus_id, gpu.name) == (
        0, UUID, "00000000:00:09.0", "NVIDIA H100 80GB HBM3")
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.driver) == (81559, 0, "590.48.01")
    assert gpu.ecc_uncorrected == 0
    assert gpu.retired_pages_pending is None
    assert dict(gpu.unknown) == {"retired_pages.pending": "[N/A]"}
    assert (gpu.remap_pending, gpu.remap_failure) == (False, False)
    assert not gpus.unhealthy(snap) and not gpus.busy(snap)


@pytest.mark.parametrize("spelling", UNKNOWN_SPELLINGS, ids=repr)
def test_every_spelling_of_no_value_is_unknown_never_a_number_or_a_flag(spelling: str) -> None:
    """[N/A], N/A, [Not Supported], an empty field, an NVML error token: unknown."""
    snap = parse(row(0, used=spelling, ecc=spelling, retired=spelling),
                 remap_row(0, pending=spelling, failure=spelling, unc=spelling))

    (gpu,) = snap.gpus
    assert (gpu.memory_used_mib, gpu.ecc_uncorrected, gpu.retired_pages_pending) == (
        None, None, None)
    assert (gpu.remap_pending, gpu.remap_failure, gpu.remapped_uncorrectable) == (
        None, None, None)
    assert dict(gpu.unknown)["ecc.errors.uncorrected.volatile.total"] == spelling
    assert not gpus.unhealthy(snap)
    assert not gpus.busy(snap)


@pytest.mark.parametrize(("pending", "failure", "expected"), [
    ("No", "No", (False, False)), ("Yes", "No", (True, False)), ("No", "Yes", (False, True)),
    ("0", "0", (False, False)), ("1", "0", (True, False)), ("0", "1", (False, True)),
])
def test_remapping_flags_read_in_both_spellings_drivers_print(
    pending: str, failure: str, expected: tuple[bool, bool]
) -> None:
    """Yes/No (the H100 capture) and 1/0 (azhpc-diagnostics' check of real output)."""
    snap = parse(row(0), remap_row(0, pending=pending, failure=failure))

    (gpu,) = snap.gpus
    assert (gpu.remap_pending, gpu.remap_failure) == expected
    kinds = gpus.unhealthy(snap).kinds()
    assert ("row-remap-pending" in kinds, "row-remap-failure" in kinds) == expected


def test_values_with_units_read_as_without() -> None:
    """A csv without nounits (81559 MiB, 2566 MiB) reads the same numbers."""
    snap = parse(row(0, used="2566 MiB").replace("81559", "81559 MiB"),
                 apps="GPU-6d2b0c1e-0000-4000-8000-000000000000, 11327, 2566 MiB, "
                      "/root/tools/memhog\n")

    (gpu,) = snap.gpus
    assert (gpu.memory_total_mib, gpu.memory_used_mib) == (81559, 2566)
    assert snap.apps is not None and snap.apps[0].used_memory_mib == 2566


def test_a_comma_in_a_product_or_process_name_stays_in_the_name() -> None:
    """The name fields come last, so their commas cannot shift the other fields."""
    snap = parse(row(0, name="NVIDIA A100, rev 2"),
                 apps="GPU-6d2b0c1e-0000-4000-8000-000000000000, 7, 100, python -c a,b\n")

    assert snap.gpus[0].name == "NVIDIA A100, rev 2"
    assert snap.apps is not None and snap.apps[0].process_name == "python -c a,b"


@pytest.mark.parametrize(("message", "index"), [
    ("Unable to determine the device handle for GPU 0000:3A:00.0: Unknown Error", None),
    ("Unable to determine the device handle for GPU0000:3A:00.0: Unknown Error", None),
    ("Unable to determine the device handle for GPU2: 0000:3A:00.0: Unknown Error", 2),
    ("Unable to determine the device handle for gpu 0000:3a:00.0: Unknown Error", None),
], ids=["spaced", "joined", "indexed", "lowercase"])
def test_a_gpu_nvml_cannot_reach_is_named_and_the_other_rows_are_kept(
    message: str, index: int | None
) -> None:
    """The message, its non-zero exit and the other GPUs' rows: three GPUs, one lost."""
    text = "\n".join([row(0), row(1), message, row(3)]) + "\n"
    snap = parse(text, remap=None, apps=None, status=255)

    assert snap.problem is None and snap.listed
    assert [gpu.index for gpu in snap.gpus] == [0, 1, 3]
    (lost,) = snap.lost
    assert lost.bus_id == "00000000:3A:00.0"  # the pci.bus_id form, whatever the message's
    assert lost.index == index
    assert lost.reason == "Unknown Error"
    assert lost.line == message
    (finding,) = gpus.unhealthy(snap).findings
    assert finding.kind == "unreachable" and finding.bus_id == "00000000:3A:00.0"
    assert message in gpus.unhealthy(snap).describe()


def test_a_lost_gpu_message_on_stderr_is_read_too() -> None:
    """Whichever stream a driver uses for it."""
    lost = "Unable to determine the device handle for GPU0000:3A:00.0: GPU is lost"
    snap = parse(row(0), remap=None, apps=None, status=15, stderr=lost + "\n")

    assert [gpu.index for gpu in snap.gpus] == [0]
    assert snap.lost[0].reason == "GPU is lost"


def test_a_listing_of_nothing_but_a_lost_gpu_does_not_count_the_others_gone() -> None:
    """A driver that stops at the first lost GPU: the GPU is named, the rest unknown."""
    start = parse("\n".join(row(i) for i in range(4)) + "\n")
    now = parse("Unable to determine the device handle for GPU0000:38:00.0: Unknown Error\n",
                status=255)

    assert now.problem is None and not now.listed
    verdict = gpus.changed(start, now)
    assert [(f.kind, f.index, f.uuid) for f in verdict.findings] == [
        ("unreachable", 2, start.gpus[2].uuid)]


def test_a_warning_on_stderr_beside_the_rows_is_a_warning_not_a_failure() -> None:
    """Exit 0 with a warning on stderr: the GPUs are there, the warning kept."""
    warning = "WARNING: infoROM is corrupted at gpu 0000:18:00.0"
    snap = parse(row(0) + "\n", remap_row(0) + "\n", "", stderr=warning + "\n")

    assert snap.problem is None and len(snap.gpus) == 1
    assert snap.warnings == (warning,)  # once, though all three queries printed it


def test_complete_rows_beside_a_non_zero_exit_are_kept() -> None:
    """The infoROM warning exits 14 after complete output: the rows still count."""
    snap = parse(row(0) + "\n", stderr="WARNING: infoROM is corrupted at gpu 0000:18:00.0\n",
                 status=14)

    assert snap.problem is None and snap.listed and len(snap.gpus) == 1
    assert snap.queries[0].detail == "exit 14"


@pytest.mark.parametrize(("output", "status"), [
    (DRIVER_UNREACHABLE + "\n", 9),
    (NVML_MISMATCH + "\nNVML library version: 535.161\n", 18),
])
def test_a_failing_nvidia_smi_is_failed_and_says_what_it_said(output: str, status: int) -> None:
    """No row, no lost GPU, a non-zero exit: failed, with its own words."""
    snap = parse(output, output, output, status=status)

    assert snap.problem == "failed" and not snap.gpus and not snap.listed
    assert snap.detail.startswith(f"exit {status}: ")
    assert output.splitlines()[0] in snap.detail
    assert output.splitlines()[0] in snap.describe_problem()
    assert not gpus.unhealthy(snap) and not gpus.busy(snap)


def test_no_devices_found_is_an_answer_of_no_gpus() -> None:
    """nvidia-smi's 'No devices were found' (exit 6): listed, none."""
    snap = parse("No devices were found\n", "No devices were found\n", "No devices were found\n",
                 status=6)

    assert snap.problem is None and snap.listed and snap.gpus == ()


def test_a_failing_remap_or_apps_query_is_unknown_not_a_problem() -> None:
    """An nvidia-smi without --query-remapped-rows: remapping unknown, a warning."""
    refused = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
    answers = {"gpu": Answer(row(0) + "\n"), "remapped-rows": Answer(refused, "", 2),
               "compute-apps": Answer(refused, "", 2)}
    snap = gpus.parse_snapshot(answers)

    assert snap.problem is None
    assert snap.gpus[0].remap_pending is None and snap.apps is None
    assert any(w.startswith("--query-remapped-rows failed: exit 2") for w in snap.warnings)


def test_lines_with_commas_that_are_not_rows_are_not_read_as_gpus() -> None:
    """A message that happens to hold as many commas as a row is no GPU."""
    message = "Note: a, b, c, d, e, f, g, h, i"
    snap = parse(message + "\n" + row(0) + "\n")

    assert [gpu.index for gpu in snap.gpus] == [0]
    assert message in snap.warnings


@given(st.text(), st.text(), st.integers(-1, 255), st.booleans())
def test_parsing_any_output_gives_a_snapshot(out: str, err: str, status: int, hung: bool) -> None:
    """Whatever nvidia-smi prints, the parser answers (and never raises)."""
    answer = Answer(out, err, None if hung else status, hung=hung)
    snap = gpus.parse_snapshot({"gpu": answer, "remapped-rows": answer, "compute-apps": answer})

    assert isinstance(snap, Snapshot)
    assert snap.problem in (None, "failed", "hung")
    snap.evidence()
    gpus.unhealthy(snap).describe()


# --- the fake prints what the real tool printed -------------------------------------------


def test_the_fake_prints_compute_apps_as_the_h100_capture_shows_them() -> None:
    """Header with canonical names and [MiB], ", " between values, units on values."""
    host = FakeHost.h100s(1)
    host.gpus[0].uuid = UUID
    host.apps = [FakeApp(UUID, 11327, "/root/tools/memhog", 2566),
                 FakeApp(UUID, 11345, "./gpu_burn", 15690)]

    out = render(host, ["--query-compute-apps=gpu_uuid,pid,process_name,used_gpu_memory",
                        "--format=csv"])

    assert (out.stdout, out.status) == (
        "gpu_uuid, pid, process_name, used_gpu_memory [MiB]\n"
        f"{UUID}, 11327, /root/tools/memhog, 2566 MiB\n"
        f"{UUID}, 11345, ./gpu_burn, 15690 MiB\n", 0)
    idle = render(FakeHost.h100s(1), ["--query-compute-apps=gpu_uuid,pid", "--format=csv"])
    assert idle.stdout == "gpu_uuid, pid\n"  # no process: the header alone


def test_the_fake_heads_an_alias_with_the_canonical_name() -> None:
    """--query-gpu=gpu_name,gpu_bus_id heads name, pci.bus_id (stas00/ml-engineering)."""
    out = render(FakeHost.h100s(1), ["--query-gpu=gpu_name,gpu_bus_id,memory.total",
                                     "--format=csv"])

    assert out.stdout == ("name, pci.bus_id, memory.total [MiB]\n"
                          "NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559 MiB\n")


def test_the_fake_refuses_what_nvidia_smi_refuses() -> None:
    """Two query switches, an unknown field, remapped rows in --query-gpu (535)."""
    host = FakeHost.h100s(1)

    both = render(host, ["--query-gpu=index", "--query-compute-apps=pid", "--format=csv"])
    field = render(host, ["--query-gpu=index,remapped_rows.pending", "--format=csv"])
    nothing = render(host, ["--query-gpu=index"])

    assert both.status == 2 and "Invalid combination of input arguments" in both.stdout
    assert (field.stdout, field.status) == (
        'Field "remapped_rows.pending" is not a valid field to query.\n', 2)
    assert nothing.status == 2


def test_the_fake_answers_hostprobe_as_the_marker_shows_it_and_a_snapshot_agrees(
    fake: FakeNvidiaSmi,
) -> None:
    """The host evidence HostProbe gives and that of one snapshot taken directly are
    equal, the machine's id (its GPUs' UUIDs) included."""
    probe = HostProbe(fake.env())
    facts = probe.facts(FACTS_WAIT_S + 10)
    snap = gpus.snapshot(fake.env())

    assert facts is not None and facts.problem is None
    assert facts_of(os.uname().nodename, snap).evidence() == facts.evidence()
    assert facts.id == ",".join(sorted(gpu.uuid for gpu in fake.host().gpus))
    assert len(facts.gpus) == 8 and facts.driver == "550.54.15"
    assert {call[0].split("=")[0] for call in fake.calls()} == {
        "--query-gpu", "--query-remapped-rows", "--query-compute-apps"}


# --- snapshots through the fake ------------------------------------------------------------


def test_a_snapshot_asks_the_three_queries_once_each(fake: FakeNvidiaSmi) -> None:
    """--query-gpu, --query-remapped-rows, --query-compute-apps, csv,noheader,nounits."""
    snap = gpus.snapshot(fake.env())

    assert snap.problem is None and snap.listed and len(snap.gpus) == 8
    assert snap.apps == ()
    assert sorted(fake.calls()) == sorted([list(args) for args in gpus.QUERIES.values()])
    assert all(call[-1] == "--format=csv,noheader,nounits" for call in fake.calls())
    assert {q.name: q.outcome for q in snap.queries} == {
        "gpu": "answered", "remapped-rows": "answered", "compute-apps": "answered"}
    assert snap.seconds < 10


def test_a_sick_busy_host_is_read_through_the_fake(fake: FakeNvidiaSmi) -> None:
    """ECC errors, a remapping failure and a foreign process, each named by GPU."""
    host = fake.host()
    host.gpus[3].ecc_uncorrected = 2
    host.gpus[5].remap_failure = True
    host.gpus[0].memory_used_mib = 30000
    host.apps.append(FakeApp(host.gpus[0].uuid, 4242, "/usr/bin/python3", 30000))
    fake.set(host)

    snap = gpus.snapshot(fake.env())

    sick = gpus.unhealthy(snap)
    assert [(f.kind, f.index, f.uuid) for f in sick.findings] == [
        ("ecc-uncorrected", 3, host.gpus[3].uuid), ("row-remap-failure", 5, host.gpus[5].uuid)]
    assert f"GPU 3 ({host.gpus[3].uuid}) reports 2 uncorrectable ECC errors" in sick.describe()
    taken = gpus.busy(snap)
    assert [(f.kind, f.index) for f in taken.findings] == [("memory-used", 0), ("compute-app", 0)]
    assert taken.evidence()[1]["pid"] == 4242
    assert "pid 4242" in taken.describe()


def test_a_refused_health_field_is_asked_again_without_it(fake: FakeNvidiaSmi) -> None:
    """A driver that dropped retired_pages.pending: the GPUs and their ECC counts remain."""
    host = fake.host()
    host.refuse = ["retired_pages.pending"]
    host.gpus[2].ecc_uncorrected = 1
    fake.set(host)

    snap = gpus.snapshot(fake.env())

    assert snap.problem is None and len(snap.gpus) == 8
    assert [f.index for f in gpus.unhealthy(snap).findings] == [2]
    assert any("retired_pages.pending" in w for w in snap.warnings)
    gpu_calls = [c for c in fake.calls() if c[0].startswith("--query-gpu=")]
    assert len(gpu_calls) == 2 and "retired_pages.pending" not in gpu_calls[1][0]


def test_no_nvidia_smi_is_absent_and_runs_nothing() -> None:
    """Not on PATH: absent, at once, no host evidence."""
    started = time.monotonic()
    snap = gpus.snapshot({"PATH": bare_path()})

    assert snap.problem == "absent"
    assert time.monotonic() - started < 0.5
    assert facts_of("h", snap).evidence() is None
    assert not gpus.unhealthy(snap) and not gpus.busy(snap)


def test_a_failing_nvidia_smi_through_the_fake_is_failed(fake: FakeNvidiaSmi) -> None:
    """The driver unreachable: failed, exit 9, its message in the detail."""
    host = fake.host()
    host.failure = DRIVER_UNREACHABLE
    fake.set(host)

    snap = gpus.snapshot(fake.env())

    assert snap.problem == "failed"
    assert snap.detail == f"exit 9: {DRIVER_UNREACHABLE}"[: gpus.MESSAGE_CHARS]


def test_a_silent_apps_query_is_killed_at_its_bound_and_leaves_only_its_part_unknown(
    fake: FakeNvidiaSmi,
) -> None:
    """--query-compute-apps never answers: killed at the bound, its part unknown (a
    warning), no problem: --query-gpu answered, and the GPUs' rows are kept."""
    host = fake.host()
    host.hang = ["--query-compute-apps"]
    fake.set(host)

    started = time.monotonic()
    snap = gpus.snapshot(fake.env(), timeout_s=1.0)
    took = time.monotonic() - started

    assert 1.0 <= took < 1.0 + bounded.KILL_GRACE_S + 1.0, took
    assert snap.problem is None and snap.listed and len(snap.gpus) == 8
    assert snap.apps is None and not gpus.busy(snap)
    assert any("--query-compute-apps did not answer within 1s" in w for w in snap.warnings)
    assert {q.name: q.outcome for q in snap.queries}["compute-apps"] == "hung"
    (hung,) = [e for e in fake._log() if e["hang"]]
    assert not Path(f"/proc/{hung['pid']}").exists()  # killed and reaped


def test_each_query_ends_on_its_own_answer_and_a_partial_snapshot_shows_what_came(
    fake: FakeNvidiaSmi,
) -> None:
    """A slow --query-gpu does not hold back the others' answers: the partial snapshot
    has the apps (and a busy GPU's process) while the GPUs are still pending."""
    host = fake.host()
    host.delay = {"--query-gpu": 3.0}
    host.apps.append(FakeApp(host.gpus[2].uuid, 4242, "python3", 9000))
    fake.set(host)

    pending = gpus.start(fake.env(), timeout_s=30)
    deadline = time.monotonic() + 10
    while pending.partial().apps is None and time.monotonic() < deadline:
        pending.wait(0.1)
    partial = pending.partial()

    assert partial.problem == "pending" and not partial.listed and not partial.complete
    assert partial.apps is not None and partial.apps[0].pid == 4242
    verdict = gpus.before_setup(partial)
    assert (verdict.kind, verdict.decided) == ("busy", True)  # judged the moment it came
    whole = pending.result(30)
    assert whole is not None and whole.problem is None and whole.complete
    assert whole.seconds >= 3.0


def test_the_bound_can_move_while_the_queries_run(fake: FakeNvidiaSmi) -> None:
    """Started with the runner's bound, limited to the payload's: killed at the new one."""
    host = fake.host()
    host.hang = ["--query-gpu"]
    fake.set(host)

    pending = gpus.start(fake.env(), timeout_s=600)
    pending.limit(1.0)
    snap = pending.result(10)

    assert snap is not None and snap.problem == "hung"
    assert gpus.before_setup(snap).kind == "unresponsive"
    assert "did not answer within 1s (FLASH_GPU_QUERY_S)" in snap.describe_problem()


def test_a_hung_nvidia_smi_is_its_own_outcome_not_failed(fake: FakeNvidiaSmi) -> None:
    """Every query hangs: hung (never failed), within the bound asked for."""
    host = fake.host()
    host.hang = ["*"]
    fake.set(host)

    started = time.monotonic()
    snap = gpus.snapshot(fake.env(), timeout_s=0.5)

    assert time.monotonic() - started < 0.5 + bounded.KILL_GRACE_S + 1.0
    assert snap.problem == "hung" and not snap.listed and snap.gpus == ()
    assert {q.outcome for q in snap.queries} == {"hung"}


def test_a_child_that_escaped_the_process_group_holding_the_pipe_does_not_hold_the_snapshot(
    tmp_path: Path,
) -> None:
    """A grandchild in its own session keeps stdout open: the snapshot still ends."""
    if shutil.which("setsid") is None:
        pytest.skip("no setsid(1) on this machine")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    pidfile = tmp_path / "escaped.pid"
    smi = bindir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nsetsid sleep 30 &\necho $! >> {pidfile}\nexec sleep 30\n")
    smi.chmod(0o755)
    try:
        started = time.monotonic()
        snap = gpus.snapshot({"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"},
                             timeout_s=0.5)
        assert time.monotonic() - started < 0.5 + bounded.KILL_GRACE_S + 1.0
        assert snap.problem == "hung"
    finally:
        for pid in pidfile.read_text().split() if pidfile.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_a_pending_snapshot_does_not_block_and_ends_hung(fake: FakeNvidiaSmi) -> None:
    """Taken in the background: None while it runs, the hung snapshot at its bound."""
    host = fake.host()
    host.hang = ["*"]
    fake.set(host)

    pending = gpus.start(fake.env(), timeout_s=0.5)

    assert pending.result(0) is None and not pending.done()
    snap = pending.result()
    assert snap is not None and snap.problem == "hung" and pending.done()


def test_a_gpu_lost_and_new_ecc_errors_mid_run_are_the_changes(fake: FakeNvidiaSmi) -> None:
    """The state changes between two snapshots, as in a run: both changes, by GPU."""
    start = gpus.snapshot(fake.env())
    host = fake.host()
    host.gpus[6].unreachable = "Unknown Error"
    host.gpus[1].ecc_uncorrected = 4
    fake.set(host)

    now = gpus.snapshot(fake.env())

    verdict = gpus.changed(start, now)
    assert [(f.kind, f.index, f.uuid) for f in verdict.findings] == [
        ("ecc-rose", 1, host.gpus[1].uuid), ("unreachable", 6, host.gpus[6].uuid)]
    assert "0 at the start, 4 now" in verdict.describe()
    assert "Unable to determine the device handle for GPU0000:BA:00.0" in verdict.describe()
    assert gpus.changed(start, gpus.snapshot(fake.env())) == verdict  # asked again: the same


@pytest.mark.parametrize("silence", ["hang", "nvml-unknown", "driver-unreachable"])
def test_silence_or_a_whole_tool_failure_mid_run_is_no_change(
    fake: FakeNvidiaSmi, silence: str
) -> None:
    """It answered at the start; now it hangs, or fails as a whole (the container lost
    NVML, [16]): nothing about a GPU was said, so nothing changed."""
    start = gpus.snapshot(fake.env())
    host = fake.host()
    if silence == "hang":
        host.hang = ["*"]
    else:
        host.failure = NVML_UNKNOWN if silence == "nvml-unknown" else DRIVER_UNREACHABLE
        host.failure_status = 255 if silence == "nvml-unknown" else 9
    fake.set(host)

    now = gpus.snapshot(fake.env(), timeout_s=0.5)

    assert now.problem in ("hung", "failed")
    assert not gpus.changed(start, now)


def test_a_gpu_lost_in_nvmls_other_words_is_reached_by_no_one(fake: FakeNvidiaSmi) -> None:
    """"GPU is lost. Reboot the system to recover this GPU" ([15]) names the GPU."""
    start = gpus.snapshot(fake.env())
    host = fake.host()
    host.gpus[2].unreachable = GPU_IS_LOST
    fake.set(host)

    verdict = gpus.changed(start, gpus.snapshot(fake.env()))

    assert [(f.kind, f.uuid) for f in verdict.findings] == [("unreachable", host.gpus[2].uuid)]
    assert "GPU is lost" in verdict.describe()


@pytest.mark.parametrize(("line", "bus"), [
    # NVIDIA/dcgm-exporter#604: a three-digit domain
    ("Unable to determine the device handle for GPU 000:BA:80.0: Unknown Error",
     "00000000:BA:80.0"),
    # marian-nmt/marian#251: two spaces before "Reboot"
    ("Unable to determine the device handle for GPU 0000:03:00.0: GPU is lost.  Reboot the "
     "system to recover this GPU", "00000000:03:00.0"),
])
def test_lost_gpu_messages_as_users_posted_them_are_read(line: str, bus: str) -> None:
    """Lost-GPU lines in the spellings users posted: the GPU named by its bus id."""
    snap = parse(row(0) + "\n" + line + "\n", status=15)
    assert [lost.bus_id for lost in snap.lost] == [bus]
    assert snap.problem is None


def test_snapshot_evidence_is_json_for_the_marker(fake: FakeNvidiaSmi) -> None:
    """Everything a snapshot and a verdict carry survives json.dumps."""
    host = fake.host()
    host.gpus[0].unreachable = "Unknown Error"
    fake.set(host)
    snap = gpus.snapshot(fake.env())

    data = json.loads(json.dumps({"snapshot": snap.evidence(),
                                  "unhealthy": gpus.unhealthy(snap).evidence()}))
    assert data["snapshot"]["lost"][0]["bus_id"] == "00000000:18:00.0"
    assert data["unhealthy"][0]["kind"] == "unreachable"
    assert data["snapshot"]["queries"]["gpu"]["status"] == 255


def _loaded_by(module: str) -> list[str]:
    """The modules that ``import <module>`` loads in a fresh interpreter."""
    code = ("import json, sys; before = set(sys.modules); "
            f"import {module}; print(json.dumps(sorted(set(sys.modules) - before)))")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {root!r}); "
                          + code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert isinstance(loaded, list)
    return loaded


def test_importing_fsm_gpus_loads_only_the_standard_library() -> None:
    """It runs on the start path, before any setup: nothing but stdlib modules load."""
    loaded = _loaded_by("fsm.host.gpus")
    foreign = [m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names
               and m not in ("fsm", "fsm.host", "fsm.host.gpus", "fsm.host.queries",
                             "fsm.worker", "fsm.worker.bounded", "fsm.clock")]
    assert "fsm.host.gpus" in loaded and foreign == []


def test_the_gpus_are_asked_before_anything_costly_is_imported() -> None:
    """The queries start among the runner's first instructions (``fsm.launch``): what
    starts them loads only the standard library's process plumbing, not ``typing``,
    ``dataclasses`` or ``shutil`` (each milliseconds between the start and the question)."""
    loaded = _loaded_by("fsm.host.queries")
    foreign = [m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names
               and m not in ("fsm", "fsm.host", "fsm.host.queries")]
    assert foreign == []
    assert not {"typing", "dataclasses", "inspect", "shutil"} & set(loaded)


# --- the verdicts, over generated host states ----------------------------------------------


HEALTH = {  # field as nvidia-smi names it -> FakeGpu attribute
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected",
    "retired_pages.pending": "retired_pages_pending",
    "remapped_rows.pending": "remap_pending",
    "remapped_rows.failure": "remap_failure",
}
maybe_count = st.one_of(st.none(), st.integers(0, 3))
maybe_flag = st.one_of(st.none(), st.booleans())


@st.composite
def hosts(draw: st.DrawFn, *, unreachable: bool = True) -> FakeHost:
    """A host of 1 to 8 GPUs: health values known or unknown (spelled any way nvidia-smi
    spells no value), memory in use, compute processes, maybe GPUs NVML cannot reach."""
    host = FakeHost.h100s(draw(st.integers(1, 8)))
    host.remap_flags = draw(st.sampled_from(["yes_no", "digits"]))
    host.lost_style = draw(st.sampled_from(["bus", "spaced", "indexed"]))
    for gpu in host.gpus:
        gpu.ecc_uncorrected = draw(maybe_count)
        gpu.retired_pages_pending = draw(maybe_flag)
        gpu.remap_pending = draw(maybe_flag)
        gpu.remap_failure = draw(maybe_flag)
        gpu.memory_used_mib = draw(st.one_of(st.none(), st.sampled_from([0, 4, 1024, 1025, 30000])))
        for name, attr in HEALTH.items():
            if getattr(gpu, attr) is None:
                gpu.spellings[name] = draw(st.sampled_from(UNKNOWN_SPELLINGS))
        if unreachable and draw(st.integers(0, 5)) == 0:
            gpu.unreachable = draw(st.sampled_from(["Unknown Error", "GPU is lost"]))
        for _ in range(draw(st.integers(0, 2))):
            host.apps.append(FakeApp(gpu.uuid, draw(st.integers(1, 99999)),
                                     draw(st.sampled_from(["python3", "./gpu_burn", None])),
                                     draw(st.one_of(st.none(), st.integers(0, 80000)))))
    return host


def sick_by_oracle(host: FakeHost) -> set[tuple[str, str]]:
    """What the host's reachable GPUs report, as (uuid, finding kind), from the host itself."""
    found = set()
    for gpu in host.gpus:
        if gpu.unreachable is not None:
            continue
        if gpu.ecc_uncorrected:
            found.add((gpu.uuid, "ecc-uncorrected"))
        if gpu.retired_pages_pending:
            found.add((gpu.uuid, "retired-pages-pending"))
        if gpu.remap_pending:
            found.add((gpu.uuid, "row-remap-pending"))
        if gpu.remap_failure:
            found.add((gpu.uuid, "row-remap-failure"))
    return found


@given(hosts())
def test_unhealthy_is_what_the_gpus_report_and_unknown_is_never_sick(host: FakeHost) -> None:
    """Exactly the known bad values are findings; unknown fields never are."""
    snap = snap_of(host)
    verdict = gpus.unhealthy(snap)

    per_gpu = {(f.uuid, f.kind) for f in verdict.findings if f.kind != "unreachable"}
    assert per_gpu == sick_by_oracle(host)
    lost = [gpu for gpu in host.gpus if gpu.unreachable is not None]
    assert len([f for f in verdict.findings if f.kind == "unreachable"]) == len(lost)
    for finding in verdict.findings:
        if finding.kind != "unreachable":
            index = next(i for i, g in enumerate(host.gpus) if g.uuid == finding.uuid)
            assert finding.index == index and finding.text.startswith(f"GPU {index} (")
    assert bool(verdict) == bool(verdict.describe())


@given(hosts(unreachable=False), st.data())
def test_forgetting_health_values_never_adds_a_finding(host: FakeHost, data: st.DataObject) -> None:
    """Known values made unknown (any spelling of no value) only ever remove findings."""
    blind = copy.deepcopy(host)
    for gpu in blind.gpus:
        for name, attr in HEALTH.items():
            if data.draw(st.booleans()):
                setattr(gpu, attr, None)
                gpu.spellings[name] = data.draw(st.sampled_from(UNKNOWN_SPELLINGS))
    every = copy.deepcopy(blind)
    for gpu in every.gpus:
        for name, attr in HEALTH.items():
            setattr(gpu, attr, None)
            gpu.spellings[name] = "[Not Supported]"

    found = {(f.uuid, f.kind) for f in gpus.unhealthy(snap_of(host)).findings}
    assert {(f.uuid, f.kind) for f in gpus.unhealthy(snap_of(blind)).findings} <= found
    assert not gpus.unhealthy(snap_of(every))


@given(hosts(), st.data())
def test_busy_is_memory_over_a_gib_or_a_foreign_process(
    host: FakeHost, data: st.DataObject
) -> None:
    """More than 1024 MiB used, or any process not the attempt's own; unknown is neither."""
    own = set(data.draw(st.lists(st.sampled_from([a.pid for a in host.apps] or [0]))))
    verdict = gpus.busy(snap_of(host), own_pids=own)

    reachable = {gpu.uuid: gpu for gpu in host.gpus if gpu.unreachable is None}
    expected = set()
    for uuid, gpu in reachable.items():
        on_it = [a for a in host.apps if a.gpu_uuid == uuid]
        mine = any(a.pid in own for a in on_it)
        if gpu.memory_used_mib is not None and not mine and (
                gpu.memory_used_mib + sum(a.used_memory_mib or 0 for a in on_it) > 1024):
            expected.add((uuid, "memory-used", None))
    for app in host.apps:
        if app.gpu_uuid in reachable and app.pid not in own:
            expected.add((app.gpu_uuid, "compute-app", app.pid))
    found = {(f.uuid, f.kind, dict(f.reported).get("pid")) for f in verdict.findings}
    assert found == expected


@given(hosts())
def test_nothing_changed_between_a_snapshot_and_itself(host: FakeHost) -> None:
    """changed(s, s) is empty, and so is changed of two snapshots of one state."""
    snap = snap_of(host)

    assert not gpus.changed(snap, snap)
    assert not gpus.changed(snap, snap_of(host))


@given(hosts(unreachable=False), st.data())
def test_an_ecc_count_that_did_not_rise_is_no_change_and_one_that_rose_is(
    host: FakeHost, data: st.DataObject
) -> None:
    """Lower, equal or unknown later: nothing; higher than a known count: that GPU."""
    later = copy.deepcopy(host)
    rose = set()
    for gpu in later.gpus:
        before = gpu.ecc_uncorrected
        choice = data.draw(st.sampled_from(["same", "unknown", "lower", "higher"]))
        if choice == "unknown":
            gpu.ecc_uncorrected = None
        elif choice == "lower" and before:
            gpu.ecc_uncorrected = before - 1
        elif choice == "higher":
            gpu.ecc_uncorrected = (before or 0) + data.draw(st.integers(1, 5))
            if before is not None:
                rose.add(gpu.uuid)

    verdict = gpus.changed(snap_of(host), snap_of(later))

    assert {f.uuid for f in verdict.findings if f.kind == "ecc-rose"} == rose
    assert verdict.kinds() <= {"ecc-rose"}


@given(hosts(unreachable=False), st.data())
def test_a_gpu_gone_or_unreachable_is_always_reported_with_its_uuid(
    host: FakeHost, data: st.DataObject
) -> None:
    """Each GPU removed from the listing or lost to NVML is named by its start UUID."""
    later = copy.deepcopy(host)
    removed = set(data.draw(st.sets(st.sampled_from([g.uuid for g in host.gpus]), min_size=1)))
    later.gpus = [g for g in later.gpus if g.uuid not in removed]
    lost = set(data.draw(st.sets(st.sampled_from([g.uuid for g in later.gpus] or [""]))))
    for gpu in later.gpus:
        if gpu.uuid in lost:
            gpu.unreachable = "Unknown Error"

    now = snap_of(later)
    verdict = gpus.changed(snap_of(host), now)

    reported = {f.uuid: f.kind for f in verdict.findings}
    for uuid in lost - {""}:
        assert reported.get(uuid) == "unreachable"
    # A listing of nothing but lost GPUs may have stopped at the first: then the removed
    # ones are unknown, not gone. Any other listing names every removed GPU.
    only_lost = bool(later.gpus) and all(g.uuid in lost for g in later.gpus)
    assert now.listed != only_lost
    if now.listed:
        for uuid in removed:
            assert reported.get(uuid) == "gone"
    assert all(f.uuid is not None and f.index is not None for f in verdict.findings)


def test_the_fake_nvidia_smi_example_of_docs_testing_md_runs_and_passes(tmp_path: Path) -> None:
    """The example under docs/testing.md's "A fake nvidia-smi", as written."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "testing.md").read_text()
    section = docs.split("## A fake `nvidia-smi`", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "test_fake_smi_example.py").write_text(example)

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout


def test_a_precomputed_fake_answers_as_the_python_one_does(tmp_path: Path) -> None:
    """The benchmarks' fake (the runner's queries answered by ``cat``) gives the snapshot
    the Python fake gives, before and after the host changes."""
    host = FakeHost.h100s(4)
    host.apps.append(FakeApp(host.gpus[1].uuid, 4242, "/usr/bin/python3", 30000))
    plain = FakeNvidiaSmi(tmp_path / "plain", host)
    quick = FakeNvidiaSmi(tmp_path / "quick", host, precompute=list(gpus.QUERIES.values()))

    def same() -> None:
        a, b = gpus.snapshot(plain.env()), gpus.snapshot(quick.env())
        assert (a.gpus, a.apps, a.lost, a.problem) == (b.gpus, b.apps, b.lost, b.problem)

    same()
    assert quick.calls() == []  # answered by the script alone
    host.gpus[2].ecc_uncorrected = 3
    host.gpus[3].unreachable = "Unknown Error"  # a failing answer: Python answers it
    plain.set(host)
    quick.set(host)
    same()
    assert quick.calls() != []


def test_the_early_lookup_finds_what_shutil_which_finds(tmp_path: Path) -> None:
    """``fsm.host.queries.find`` stands in for ``shutil.which`` (whose import costs
    milliseconds before the GPUs are asked): the same answer on every kind of PATH."""
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / "dir" / "nvidia-smi").mkdir(parents=True)  # a folder of that name
    (tmp_path / "noexec").mkdir()
    (tmp_path / "noexec" / "nvidia-smi").write_text("")  # not executable
    bins, folder, noexec = (str(tmp_path / name) for name in ("bin", "dir", "noexec"))
    for path in ("", bins, f"/nonexistent:{bins}", f"{folder}:{bins}", f"{noexec}:{bins}",
                 folder, f"{noexec}", f"::{bins}", None):
        expected = shutil.which("nvidia-smi", path=path if path is not None else os.defpath)
        assert gpu_queries.find(path) == expected, path
