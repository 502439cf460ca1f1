"""The failure policy as data: stable ids, first match wins, nothing unclassified is retried."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from fsm import policy, rules, table
from fsm.errors import (
    DeadlineExceeded,
    FatalError,
    FlashError,
    Interrupted,
    PayloadError,
    RetriableError,
    StoreAuthError,
    StoreNotFound,
    StoreRefused,
    StoreUnavailable,
)
from fsm.extras.pip import NETWORK_SIGNATURES

#: The ids the states, the watchdog and the control plane's readers of the marker rely on.
#: Renaming or removing one is a breaking change: this list changes only with intent.
STABLE_IDS = (
    "interrupted",
    "deadline",
    "payload-invalid",
    "superseded",
    "host-gpu-missing",
    "host-gpu-unhealthy",
    "host-gpu-unresponsive",
    "host-gpu-busy",
    "host-storage",
    "host-storage-filled",
    "store-auth",
    "store-refused",
    "store-unavailable",
    "pip-network",
    "pip-failed",
    "code-missing",
    "store-not-found",
    "spec-absent",
    "spec-fetch",
    "worker-launch",
    "verify-unreadable",
    "worker-heartbeat-retriable",
    "worker-upload-lost",
    "worker-oom-killed",
    "worker-host-fault",
    "host-gpu-lost",
    "worker-stalled",
    "worker-stalled-again", "fault-follows-job",
    "worker-failed",
    "store-unsafe-link",
    "worker-env-too-large",
    "preload-unmounted",
    "preload-model-failed",
    "internal-error",
    "unclassified",
)

#: The working states a rule can apply in: Mark never fails (it has no failure exits).
FAILING_STATES = tuple(s for s in table.WORKING if s != table.MARK)

#: The rule objects fsm.rules defines, by constant name.
RULE_CONSTANTS: dict[str, rules.Rule] = {
    name: value for name, value in vars(rules).items() if isinstance(value, rules.Rule)
}


def _typed(r: rules.Rule, message: str = "x") -> FlashError:
    """A typed error of ``r``'s class naming ``r``."""
    return (RetriableError if r.retriable else FatalError)(message, rule=r)


def _states_of(r: rules.Rule) -> tuple[str, ...]:
    return FAILING_STATES if r.where == rules.ANY else (r.where,)


# --- the table ----------------------------------------------------------------------------


def test_rule_ids_are_unique_and_exactly_the_stable_ones_in_order() -> None:
    ids = [r.id for r in policy.RULES]
    assert len(ids) == len(set(ids))
    assert tuple(ids) == STABLE_IDS
    assert policy.SUCCESS.id not in ids
    assert policy.SUCCESS is rules.SUCCESS


def test_a_rule_is_found_by_its_id_success_included() -> None:
    assert {r.id: r for r in policy.RULES} == policy.BY_ID
    for r in policy.RULES:
        assert policy.rule(r.id) is r
    assert policy.rule(policy.SUCCESS.id) is policy.SUCCESS
    with pytest.raises(KeyError):
        policy.rule("no-such-rule")


def test_the_last_rule_is_a_fatal_catch_all_for_any_state() -> None:
    last = policy.RULES[-1]
    assert last is policy.CATCH_ALL is rules.UNCLASSIFIED
    assert (last.id, last.where, last.retriable) == ("unclassified", policy.ANY, False)
    assert policy.claim(last).matches == (BaseException,)
    assert all(policy.claim(r).matches != (BaseException,) for r in policy.RULES[:-1])


def test_every_rule_applies_in_a_real_working_state_or_anywhere() -> None:
    for r in policy.RULES:
        assert r.where == policy.ANY or r.where in FAILING_STATES, r
    assert policy.SUCCESS.where in FAILING_STATES


def test_http_statuses_follow_the_design_table() -> None:
    assert policy.claim(rules.STORE_AUTH).statuses == (401, 403)
    unavailable = set(policy.claim(rules.STORE_UNAVAILABLE).statuses)
    # 409 and 425 too: the store's own retries take them as worth another try (issue 39)
    assert unavailable == {408, 409, 425, 429, *range(500, 600)}
    claimed = [s for r in policy.RULES for s in policy.claim(r).statuses]
    assert len(claimed) == len(set(claimed)), "one status, one rule"


def test_the_pip_network_rule_names_every_network_signature_of_the_pip_installer() -> None:
    assert policy.claim(rules.PIP_NETWORK).signatures == tuple(
        s.name for s in NETWORK_SIGNATURES
    )
    assert rules.PIP_NETWORK.retriable
    assert not rules.PIP_FAILED.retriable


def test_the_failure_exit_follows_the_rule() -> None:
    for r in policy.RULES:
        if r is rules.INTERRUPTED:
            assert r.event == table.INTERRUPTED
        elif r is rules.DEADLINE:
            assert r.event == table.DEADLINE_EXCEEDED
        else:
            assert r.event == (table.FAILED_RETRIABLE_EVENT if r.retriable
                               else table.FAILED_FATAL_EVENT), r.id
        assert r.event in table.FAILURE_EVENTS
    assert rules.INTERRUPTED.retriable
    assert not rules.DEADLINE.retriable
    assert policy.SUCCESS.event == table.COMPLETION_CONFIRMED


def test_the_exit_status_follows_the_rule() -> None:
    for r in policy.RULES:
        expected = {rules.PAYLOAD_INVALID: 2, rules.DEADLINE: 124}.get(
            r, 75 if r.retriable else 1)  # fsm/exits.py: EX_TEMPFAIL for a retriable one
        assert r.exit_status == expected, r.id
    assert policy.SUCCESS.exit_status == 0


# --- every rule is reachable, and a typed error keeps its class -----------------------------


def test_every_rule_is_a_constant_of_fsm_rules_named_for_its_id() -> None:
    failure_constants = {
        name: r for name, r in RULE_CONSTANTS.items() if r is not rules.SUCCESS
    }
    assert set(failure_constants.values()) == set(policy.RULES)
    for name, r in failure_constants.items():
        assert name == r.id.upper().replace("-", "_"), (name, r.id)


def test_no_rule_is_dead_a_typed_error_naming_it_reaches_it_in_every_state_it_applies() -> None:
    for r in policy.RULES:
        for state in _states_of(r):
            assert policy.named_rule(_typed(r)) is r
            assert policy.classify(state, _typed(r)) is r, (r.id, state)


@pytest.mark.parametrize("r", policy.RULES, ids=lambda r: r.id)
def test_a_typed_error_of_the_wrong_class_is_refused(r: rules.Rule) -> None:
    wrong = FatalError if r.retriable else RetriableError
    with pytest.raises(TypeError, match=r.id):
        wrong("x", rule=r)
    defaults = (StoreUnavailable,) if not r.retriable else (
        PayloadError, StoreAuthError, StoreNotFound
    )
    for cls in defaults:
        with pytest.raises(TypeError, match=r.id):
            cls("x", rule=r)


def test_the_typed_errors_default_to_their_rules() -> None:
    assert PayloadError("x").rule is rules.PAYLOAD_INVALID
    assert StoreUnavailable("x").rule is rules.STORE_UNAVAILABLE
    assert StoreAuthError("x").rule is rules.STORE_AUTH
    assert StoreNotFound("x").rule is rules.STORE_NOT_FOUND
    assert StoreRefused("x", fix="y").rule is rules.STORE_REFUSED


def test_success_is_no_failure_rule_a_typed_error_naming_it_ends_unclassified() -> None:
    assert policy.named_rule(FatalError("x", rule=policy.SUCCESS)) is None
    for state in table.WORKING:
        assert policy.classify(state, FatalError("x", rule=policy.SUCCESS)) is policy.CATCH_ALL


# --- classify, generated --------------------------------------------------------------------

STATES = st.sampled_from(table.WORKING) | st.text(max_size=12)
ANY_STATUS = st.integers(min_value=100, max_value=599)


@st.composite
def foreign_rules(draw: st.DrawFn) -> rules.Rule:
    """A rule the policy lacks: made up, a known one altered, or the success rule."""
    retriable = draw(st.booleans())
    made_up = st.builds(
        rules.Rule,
        id=st.sampled_from(STABLE_IDS) | st.text(max_size=10),
        where=st.sampled_from((rules.ANY, *table.WORKING)),
        what=st.text(max_size=10),
        retriable=st.just(retriable),
        event=st.sampled_from(table.FAILURE_EVENTS),
        exit_status=st.integers(0, 255),
    )
    altered = st.sampled_from(policy.RULES).map(
        lambda r: r._replace(what=r.what + " (altered)")
    )
    r = draw(made_up | altered | st.just(rules.SUCCESS))
    assume(r not in policy.RULES)
    return r


class _HttpError(Exception):
    """Shaped like requests'/huggingface_hub's HTTPError: the status on ``.response``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.response = SimpleNamespace(status_code=status)


class _StatusError(Exception):
    """Shaped like urllib3's/httpx's errors: a bare ``status`` attribute."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Nasty(Exception):
    """An exception whose attributes raise when read."""

    @property
    def response(self) -> Any:
        raise RuntimeError("no response for you")


PLAIN_TYPES = (Exception, ValueError, RuntimeError, KeyError, OSError, ConnectionError,
               TimeoutError, MemoryError, UnicodeError, _Nasty, SystemError, GeneratorExit)


@st.composite
def exceptions(draw: st.DrawFn, depth: int = 0) -> BaseException:
    message = draw(st.text(max_size=20))
    kind = draw(st.sampled_from(
        ["plain", "typed", "named", "http", "status", "interrupt", "deadline", "store"]
    ))
    exc: BaseException
    if kind == "plain":
        exc = draw(st.sampled_from(PLAIN_TYPES))(message)
    elif kind == "typed":
        r = draw(st.sampled_from(policy.RULES) | foreign_rules())
        typed = draw(st.sampled_from([FlashError, RetriableError if r.retriable else FatalError]))
        exc = typed(message, rule=r)
    elif kind == "named":
        exc = _typed(draw(st.sampled_from(policy.RULES)), message)
    elif kind == "http":
        exc = _HttpError(message, draw(ANY_STATUS | st.integers()))
    elif kind == "status":
        exc = _StatusError(message, draw(ANY_STATUS))
    elif kind == "interrupt":
        exc = Interrupted(draw(st.sampled_from([2, 15])))
    elif kind == "deadline":
        exc = DeadlineExceeded(message)
    else:
        store = draw(
            st.sampled_from([StoreUnavailable, StoreAuthError, StoreNotFound, PayloadError])
        )
        exc = store(message)
    if depth < 3 and draw(st.booleans()):
        cause = draw(exceptions(depth=depth + 1))
        if draw(st.booleans()):
            exc.__cause__ = cause
        else:
            exc.__context__ = cause
        if draw(st.integers(0, 9)) == 0:
            cause.__context__ = exc  # a cycle: must not hang
    return exc


@given(STATES, exceptions())
def test_classify_is_total_deterministic_and_the_first_rule_that_claims_wins(
    state: str, exc: BaseException
) -> None:
    decided = policy.classify(state, exc)
    assert decided in policy.RULES
    assert policy.classify(state, exc) is decided
    assert policy.claims(decided, state, exc)
    earlier = policy.RULES[: policy.RULES.index(decided)]
    assert not any(policy.claims(r, state, exc) for r in earlier)


@given(STATES, st.sampled_from(policy.RULES), st.text(max_size=20))
def test_a_typed_error_naming_a_rule_is_decided_by_that_rule_in_any_state(
    state: str, named: rules.Rule, message: str
) -> None:
    assert policy.classify(state, _typed(named, message)) is named


@given(STATES, foreign_rules(), st.booleans())
def test_a_typed_error_naming_a_rule_the_policy_lacks_is_never_retried(
    state: str, foreign: rules.Rule, base: bool
) -> None:
    exc = FlashError("x", rule=foreign) if base else _typed(foreign)
    assert policy.named_rule(exc) is None
    assert policy.classify(state, exc) is rules.UNCLASSIFIED


@given(STATES, st.sampled_from(PLAIN_TYPES), st.text(max_size=20))
def test_an_error_nobody_classified_is_fatal(
    state: str, cls: type[Exception], message: str
) -> None:
    decided = policy.classify(state, cls(message))
    assert not decided.retriable
    expected = rules.WORKER_LAUNCH if state == table.TRAIN and issubclass(cls, OSError) else (
        rules.UNCLASSIFIED
    )
    assert decided is expected


@given(STATES, ANY_STATUS, st.integers(0, 5), st.booleans(), st.booleans())
def test_an_untyped_http_error_anywhere_on_the_chain_is_classified_by_its_status(
    state: str, status: int, depth: int, via_cause: bool, on_response: bool
) -> None:
    exc: BaseException = (_HttpError if on_response else _StatusError)("http", status)
    for _ in range(depth):
        wrapper = RuntimeError("wrapped")
        if via_cause:
            wrapper.__cause__ = exc
        else:
            wrapper.__context__ = exc
        exc = wrapper
    decided = policy.classify(state, exc)
    if status in (401, 403):
        assert decided is rules.STORE_AUTH
        assert not decided.retriable
    elif status in (408, 409, 425, 429) or 500 <= status <= 599:
        assert decided is rules.STORE_UNAVAILABLE
        assert decided.retriable
    else:
        assert decided is rules.UNCLASSIFIED
        assert not decided.retriable


@given(STATES, ANY_STATUS)
def test_a_typed_error_is_not_reclassified_by_a_status_on_its_cause(
    state: str, status: int
) -> None:
    exc = RetriableError("could not read", rule=rules.VERIFY_UNREADABLE)
    exc.__cause__ = _HttpError("503", status)
    assert policy.classify(state, exc) is rules.VERIFY_UNREADABLE


@given(STATES, st.sampled_from([2, 15]))
def test_a_signal_in_any_state_is_retriable_and_the_deadline_fatal(state: str, signum: int) -> None:
    assert policy.classify(state, Interrupted(signum)) is rules.INTERRUPTED
    assert policy.classify(state, KeyboardInterrupt()) is rules.INTERRUPTED
    assert policy.classify(state, DeadlineExceeded("late")) is rules.DEADLINE


@pytest.mark.parametrize("state", table.WORKING)
def test_a_missing_store_path_is_code_missing_in_fetch_code_and_store_not_found_elsewhere(
    state: str,
) -> None:
    decided = policy.classify(state, StoreNotFound("gone"))
    assert decided is (rules.CODE_MISSING if state == table.FETCH_CODE else rules.STORE_NOT_FOUND)
    assert not decided.retriable


@pytest.mark.parametrize("state", table.WORKING)
def test_store_errors_keep_their_class_in_every_state(state: str) -> None:
    assert policy.classify(state, StoreUnavailable("down")) is rules.STORE_UNAVAILABLE
    assert policy.classify(state, StoreAuthError("401")) is rules.STORE_AUTH
    assert policy.classify(state, StoreRefused("431", fix="x")) is rules.STORE_REFUSED
    assert policy.classify(state, PayloadError("bad")) is rules.PAYLOAD_INVALID


# --- the printed table -----------------------------------------------------------------------


def test_the_printed_table_lists_every_rule_once_in_order_with_its_class() -> None:
    text = policy.render_table()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    rule_rows = rows[: len(policy.RULES)]
    for r, row in zip(policy.RULES, rule_rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[0] == f"`{r.id}`"
        assert cells[-1] == r.verdict
    assert policy.SUCCESS.id in text


def test_the_printed_table_shows_every_pip_network_signature() -> None:
    text = policy.render_table()
    pip_row = next(line for line in text.splitlines() if line.startswith("| `pip-network`"))
    for sig in NETWORK_SIGNATURES:
        assert f"`{sig.name}`" in pip_row
        assert f"| `{sig.name}` | {sig.meaning} |" in text


def test_importing_the_policy_loads_no_process_store_or_installer_code() -> None:
    """The policy is a statement of which failures are retriable (issue 37): reading it,
    rendering it or property-testing it loads only the rules, the errors and the console's
    families, never the supervisor, a store or an installer."""
    shown = subprocess.run(
        [sys.executable, "-c", "import sys, fsm.policy; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith(('fsm', 'states')))))"],
        capture_output=True, check=True, timeout=60).stdout.decode().split()
    assert set(shown) <= {"fsm", "fsm.errors", "fsm.exits", "fsm.policy.families", "fsm.policy",
                          "fsm.rules", "fsm.policy.signatures", "fsm.table"}, shown
