"""Silence is not sickness (issue 36, CONTRACT section 8), as properties over what
nvidia-smi can do: answer late, hang, fail as a whole, leave one query unanswered.

Over any sequence of the host watch's looks in which no answer reports a GPU fault, the
worker is never stopped, whatever the delays and timeouts; the start's verdict is never a
host verdict but ``host-gpu-unresponsive`` (and that only for a ``--query-gpu`` killed at
its bound); and nothing is a change after a death. A fault the GPUs do report on two
answered looks, with any silence between, stops the worker."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from fsm.host import gpus
from fsm.host.gpus import Answer, Snapshot
from fsm.host.watch import GpuWatch
from fsm.testing.nvidia_smi import (
    DRIVER_UNREACHABLE,
    NVML_MISMATCH,
    NVML_UNKNOWN,
    FakeApp,
    FakeHost,
    render,
)

WHOLE_TOOL_FAILURES = [(NVML_UNKNOWN, 255), (DRIVER_UNREACHABLE, 9), (NVML_MISMATCH, 18)]


def _answer(host: FakeHost, name: str) -> Answer:
    out = render(host, gpus.QUERIES[name])
    return Answer(status=None, hung=True) if out.hang else Answer(out.stdout, out.stderr,
                                                                 out.status)


def _snapshot(host: FakeHost, silent: Mapping[str, str]) -> Snapshot:
    """What a look gets from ``host``: each query answers, or is ``hung`` (killed at its
    bound) or ``pending`` as ``silent`` says."""
    answers = {name: _answer(host, name) for name in gpus.QUERIES
               if silent.get(name) != "pending"}
    for name, how in silent.items():
        if how == "hung":
            answers[name] = Answer(status=None, hung=True)
    pending = {name for name, how in silent.items() if how == "pending"}
    return gpus.parse_snapshot(answers, pending=pending)


@st.composite
def healthy_variants(draw: st.DrawFn, start: FakeHost) -> FakeHost:
    """The start's host changed in ways that are no fault: memory in use, the worker's
    compute processes, a health counter now unknown, a warning beside the rows."""
    host = copy.deepcopy(start)
    for gpu in host.gpus:
        gpu.memory_used_mib = draw(st.integers(0, 80_000))
        if draw(st.booleans()):
            gpu.spellings["ecc.errors.uncorrected.volatile.total"] = draw(
                st.sampled_from(["[N/A]", "[Unknown Error]", "N/A", ""]))
    for _ in range(draw(st.integers(0, 3))):
        gpu = draw(st.sampled_from(host.gpus))
        host.apps.append(FakeApp(gpu.uuid, draw(st.integers(1, 99_999)), "python3", 5000))
    if draw(st.booleans()):
        host.warnings = ["WARNING: infoROM is corrupted at gpu 0000:18:00.0"]
    return host


@dataclass
class Look:
    """One look: what it gets, and how many polls it takes to come in (its delay)."""

    snapshot: Snapshot
    polls: int
    answered: bool


@st.composite
def silent_or_healthy_looks(draw: st.DrawFn, start: FakeHost) -> Look:
    host = draw(healthy_variants(start))
    kind = draw(st.sampled_from(["answer", "gpu-hung", "others-hung", "whole-tool"]))
    polls = draw(st.integers(0, 5))
    if kind == "whole-tool":
        host.failure, host.failure_status = draw(st.sampled_from(WHOLE_TOOL_FAILURES))
        return Look(_snapshot(host, {}), polls, answered=False)
    if kind == "gpu-hung":
        others = draw(st.fixed_dictionaries(
            {}, optional={"remapped-rows": st.just("hung"), "compute-apps": st.just("hung")}))
        silent = {"gpu": "hung", **others}
        return Look(_snapshot(host, silent), polls, answered=False)
    silent = {}
    if kind == "others-hung":
        silent = draw(st.fixed_dictionaries(
            {}, optional={"remapped-rows": st.just("hung"), "compute-apps": st.just("hung")}))
    return Look(_snapshot(host, silent), polls, answered=True)


class _Pending:
    """A look under way: no result for ``polls`` polls, then the snapshot."""

    def __init__(self, look: Look) -> None:
        self._look = look
        self._left = look.polls

    def result(self, wait_s: float | None = None) -> Snapshot | None:
        if self._left > 0:
            self._left -= 1
            return None
        return self._look.snapshot


def _watch(start: Snapshot, looks: list[Look]) -> tuple[GpuWatch, list[bool]]:
    """Run the watch over ``looks`` on a fake clock; what each call of look() said."""
    queue = list(looks)
    now = [0.0]

    def take(environ: Mapping[str, str], query_s: float) -> _Pending:
        return _Pending(queue.pop(0))

    watch = GpuWatch(start, {}, 30.0, clock=lambda: now[0], take=take)  # type: ignore[arg-type]
    said = []
    while queue or watch._pending is not None:
        now[0] = max(now[0], watch.due())
        said.append(watch.look())
        if said[-1]:
            break
    return watch, said


START = FakeHost.h100s(4)


@settings(max_examples=150, deadline=None)
@given(st.lists(silent_or_healthy_looks(START), min_size=1, max_size=8))
def test_where_no_answer_reports_a_fault_the_worker_is_never_stopped(looks: list[Look]) -> None:
    start = _snapshot(START, {})
    watch, said = _watch(start, looks)
    assert not any(said) and watch.verdict is None
    assert watch.looks == len(looks)
    assert watch.unanswered == sum(not look.answered for look in looks)
    for look in looks:  # after a death too: no change
        assert not gpus.changed(start, look.snapshot)


@settings(max_examples=150, deadline=None)
@given(silent_or_healthy_looks(START), st.sampled_from([None, 1, 4]))
def test_the_start_calls_no_host_sick_or_busy_on_silence(look: Look, expected: int | None
                                                         ) -> None:
    """Before the worker: with no fault in any answer, no verdict but the driver's own
    silence at its bound (unresponsive) or a short host (expect_gpus against a failing
    nvidia-smi), and none while --query-gpu is still pending."""
    snap = look.snapshot
    idle = copy.deepcopy(START)  # the start sees no worker: its processes are a tenant's
    verdict = gpus.before_setup(snap, expected)
    if snap.problem == "hung":
        assert verdict.kind == "unresponsive"
    elif snap.problem == "failed":
        assert verdict.kind == ("short" if expected else None)
    else:
        assert verdict.kind in (None, "busy")  # busy: memory or processes it does list
        assert verdict.kind != "busy" or gpus.busy(snap)
    pending = gpus.parse_snapshot({"remapped-rows": _answer(idle, "remapped-rows")},
                                  pending={"gpu", "compute-apps"})
    assert gpus.before_setup(pending, expected) == gpus.StartVerdict(None, False)


@settings(max_examples=100, deadline=None)
@given(st.lists(silent_or_healthy_looks(START), max_size=4),
       st.lists(silent_or_healthy_looks(START).filter(lambda look: not look.answered),
                max_size=3),
       st.integers(0, 3), st.sampled_from(["Unknown Error", "GPU is lost"]))
def test_a_fault_reported_on_two_answered_looks_stops_the_worker(
    before: list[Look], between: list[Look], index: int, reason: str
) -> None:
    sick = copy.deepcopy(START)
    sick.gpus[index].unreachable = reason
    fault = Look(_snapshot(sick, {}), 0, answered=True)
    start = _snapshot(START, {})
    watch, said = _watch(start, [*before, fault, *between, fault])
    assert said[-1] is True and watch.verdict is not None
    assert {f.uuid for f in watch.verdict.findings} == {START.gpus[index].uuid}
