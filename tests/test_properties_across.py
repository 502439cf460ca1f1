"""Properties of the policy across attempts (issue 37, CONTRACT section 9), over sequences
of attempts of one run: each on a host, failing with a fault seen by a witness. The control
plane retries a retriable attempt on a fresh host; the previous attempt's marker is the
evidence ``policy.across_attempts`` weighs.

- a job's fault (the same fingerprint on every host, witnessed by the console or the
  worker) is fatal by its second attempt at the latest, whatever the first one judged;
- a fault the GPUs confirm is never made fatal;
- the same fault on the same host stays retriable;
- the rule only ever turns a retriable verdict into a fatal one, never the reverse;
- whatever the store holds as the previous marker, reading it never fails: what is not a
  failed marker of this run is no evidence.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from hypothesis import given
from hypothesis import strategies as st

from fsm import policy, rules
from fsm.policy import Fault, Previous
from fsm.rules import Rule

RUN = "run-1"
HOSTS = st.sampled_from([
    "GPU-aaaa,GPU-aaab", "GPU-bbbb,GPU-bbbc", "GPU-cccc", "boot:1f2e@node-4", "boot:77aa@node-9",
])
#: Retriable worker verdicts a fault can come with, and the rule its second occurrence gets.
FOLLOWS = {rules.WORKER_HOST_FAULT: rules.FAULT_FOLLOWS_JOB,
           rules.WORKER_STALLED: rules.WORKER_STALLED_AGAIN}
RETRIABLE = st.sampled_from(sorted(FOLLOWS, key=lambda r: r.id))
#: Verdicts that stand whatever came before: the worker's own (its heartbeat), and the
#: fatal ones.
STANDS = st.sampled_from([rules.WORKER_HEARTBEAT_RETRIABLE, rules.WORKER_FAILED,
                          rules.WORKER_OOM_KILLED, rules.DEADLINE])
FINGERPRINTS = st.sampled_from([
    "interconnect: nccl warn net/ib : got completion from peer #.#.#.#<#> with status=#",
    "gpu-launch-failure: runtimeerror: cuda error: unspecified launch failure",
    "stall: train_loop (train.py:#)", "stall: train_loop (train.py:88)", "xid: nvrm: xid #",
])
WITNESSES = st.sampled_from(["console", "worker", "gpus", "runner"])


class Attempt(NamedTuple):
    host: str
    rule: Rule
    fault: Fault


@st.composite
def attempts(draw: st.DrawFn) -> Attempt:
    rule = draw(st.one_of(RETRIABLE, STANDS))
    fault = Fault(rule.id, "f", draw(FINGERPRINTS), draw(WITNESSES))
    return Attempt(draw(HOSTS), rule, fault)


def decide(now: Attempt, before: Previous | None) -> Rule:
    return policy.across_attempts(now.rule, now.fault, now.host, RUN, before)[0]


def marker_of(attempt: Attempt, rule: Rule) -> dict[str, Any]:
    """The failed marker an attempt leaves, as far as the next one reads it."""
    return {"ok": False, "retriable": rule.retriable, "run_id": RUN, "rule": rule.id,
            "attempt": 0, "host": {"id": attempt.host, "hostname": "h"},
            "fault": attempt.fault._replace(rule=rule.id)._asdict()}


def run(sequence: list[Attempt]) -> list[Rule]:
    """The verdicts of a sequence of attempts, each reading the marker the one before
    left (round-tripped through JSON, as the store keeps it)."""
    verdicts: list[Rule] = []
    before: Previous | None = None
    for attempt in sequence:
        rule = decide(attempt, before)
        verdicts.append(rule)
        before = policy.previous_of(json.loads(json.dumps(marker_of(attempt, rule))))
    return verdicts


@given(st.lists(HOSTS, min_size=2, max_size=6, unique=True), RETRIABLE, FINGERPRINTS,
       st.sampled_from(["console", "worker"]))
def test_a_jobs_fault_is_fatal_by_its_second_attempt(
    hosts: list[str], rule: Rule, fingerprint: str, witness: str
) -> None:
    """The same fault on a fresh host each time, witnessed only by the console or the
    worker: the first attempt may be retried (one attempt cannot tell), the second ends
    the run. (Two boot ids of one kind or two GPU sets name two machines; a GPU set and a
    boot id cannot be compared, so they count as no evidence.)"""
    sequence = [Attempt(host, rule, Fault(rule.id, "f", fingerprint, witness))
                for host in hosts]
    verdicts = run(sequence)
    assert verdicts[0] is rule
    comparable = hosts[0].startswith("boot:") is hosts[1].startswith("boot:")
    if comparable:
        assert verdicts[1] is FOLLOWS[rule] and not verdicts[1].retriable
    else:
        assert verdicts[1] is rule


@given(st.lists(attempts(), min_size=1, max_size=8))
def test_a_fault_the_gpus_confirm_is_never_made_fatal(sequence: list[Attempt]) -> None:
    for attempt, verdict in zip(sequence, run(sequence), strict=True):
        if attempt.fault.confirmed_by == "gpus":
            assert verdict is attempt.rule


@given(st.lists(attempts(), min_size=1, max_size=8))
def test_the_rule_only_turns_retriable_into_fatal(sequence: list[Attempt]) -> None:
    for attempt, verdict in zip(sequence, run(sequence), strict=True):
        if verdict is not attempt.rule:
            assert attempt.rule.retriable and not verdict.retriable
            assert verdict is FOLLOWS[attempt.rule]
            assert attempt.fault.confirmed_by in ("console", "worker")


@given(HOSTS, RETRIABLE, FINGERPRINTS, st.sampled_from(["console", "worker"]),
       st.integers(2, 6))
def test_the_same_fault_on_the_same_host_stays_retriable(
    host: str, rule: Rule, fingerprint: str, witness: str, times: int
) -> None:
    sequence = [Attempt(host, rule, Fault(rule.id, "f", fingerprint, witness))] * times
    assert run(sequence) == [rule] * times


@given(attempts(), attempts())
def test_the_verdict_follows_the_job_exactly_when_section_9_says(
    before: Attempt, now: Attempt
) -> None:
    """The whole rule, stated once: fatal exactly when the previous attempt ended
    retriable with the same fingerprint on another (comparable) host, and this attempt's
    retriable fault has only the console or the worker as witness."""
    previous = policy.previous_of(marker_of(before, before.rule))
    verdict = decide(now, previous)
    follows = (before.rule.retriable and now.rule in FOLLOWS
               and now.fault.confirmed_by in ("console", "worker")
               and before.fault.fingerprint == now.fault.fingerprint
               and policy.same_host(before.host, now.host) is False)
    assert verdict is (FOLLOWS[now.rule] if follows else now.rule)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(JSON, attempts())
def test_anything_in_place_of_the_previous_marker_is_evidence_or_nothing(
    stored: Any, now: Attempt
) -> None:
    previous = policy.previous_of(stored)
    assert previous is None or isinstance(previous.fault, Fault)
    verdict = decide(now, previous)
    assert verdict is now.rule or verdict is FOLLOWS.get(now.rule)


@given(attempts(), attempts(), st.sampled_from([None, "run-0", "", 7]))
def test_a_marker_of_another_run_is_no_evidence(
    before: Attempt, now: Attempt, run_id: object
) -> None:
    stored = {**marker_of(before, before.rule), "run_id": run_id}
    assert decide(now, policy.previous_of(stored)) is now.rule
