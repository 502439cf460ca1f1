"""The failure policy as data: stable ids, first match wins, nothing unclassified is retried."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm import driver, policy, table
from fsm.errors import (
    DeadlineExceeded,
    FatalError,
    FlashError,
    Interrupted,
    PayloadError,
    RetriableError,
    StoreAuthError,
    StoreNotFound,
    StoreUnavailable,
)
from fsm.pip import NETWORK_SIGNATURES

ROOT = Path(__file__).resolve().parent.parent

#: The ids the states, the watchdog and the control plane's readers of the marker rely on.
#: Renaming or removing one is a breaking change: this list changes only with intent.
STABLE_IDS = (
    "interrupted",
    "deadline",
    "payload-invalid",
    "store-auth",
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
    "worker-failed",
    "store-unsafe-link",
    "worker-env-too-large",
    "preload-unmounted",
    "preload-model-failed",
    "internal-error",
    "unclassified",
)

#: The typed errors of fsm.errors and the class each one promises.
ERROR_CLASSES: dict[str, bool] = {
    "RetriableError": True,
    "StoreUnavailable": True,
    "FatalError": False,
    "PayloadError": False,
    "StoreAuthError": False,
    "StoreNotFound": False,
}


# --- the table ----------------------------------------------------------------------------


def test_rule_ids_are_unique_and_exactly_the_stable_ones_in_order() -> None:
    ids = [r.id for r in policy.RULES]
    assert len(ids) == len(set(ids))
    assert tuple(ids) == STABLE_IDS
    assert policy.SUCCESS_RULE not in ids


def test_the_last_rule_is_a_fatal_catch_all_for_any_state() -> None:
    last = policy.RULES[-1]
    assert last is policy.CATCH_ALL
    assert (last.id, last.where, last.retriable) == ("unclassified", policy.ANY, False)
    assert last.matches == (BaseException,)
    assert all(r.matches != (BaseException,) for r in policy.RULES[:-1])


def test_every_rule_applies_in_a_real_working_state_or_anywhere() -> None:
    working = set(table.WORKING) - {table.MARK}  # Mark never fails: it has no failure exits
    for r in policy.RULES:
        assert r.where == policy.ANY or r.where in working, r


def test_http_statuses_follow_the_design_table() -> None:
    assert policy.rule("store-auth").statuses == (401, 403)
    unavailable = set(policy.rule("store-unavailable").statuses)
    assert unavailable == {408, 429, *range(500, 600)}
    claimed = [s for r in policy.RULES for s in r.statuses]
    assert len(claimed) == len(set(claimed)), "one status, one rule"


def test_the_pip_network_rule_names_every_network_signature_of_the_pip_installer() -> None:
    assert policy.rule("pip-network").signatures == tuple(s.name for s in NETWORK_SIGNATURES)
    assert policy.rule("pip-network").retriable
    assert not policy.rule("pip-failed").retriable


def test_the_failure_exit_follows_the_rule() -> None:
    for r in policy.RULES:
        event = driver.failure_event(r)
        if r.id == "interrupted":
            assert event == table.INTERRUPTED
        elif r.id == "deadline":
            assert event == table.DEADLINE_EXCEEDED
        else:
            assert event == (table.FAILED_RETRIABLE_EVENT if r.retriable
                             else table.FAILED_FATAL_EVENT)
    assert policy.rule("interrupted").retriable
    assert not policy.rule("deadline").retriable


# --- every typed error the code raises names a rule of the right class ----------------------


def _sources() -> Iterator[Path]:
    yield from sorted((ROOT / "fsm").rglob("*.py"))
    yield from sorted((ROOT / "states").glob("*.py"))


def _module_of(path: Path) -> Any:
    rel = path.relative_to(ROOT).with_suffix("")
    return importlib.import_module(".".join(rel.parts))


def _rule_value(node: ast.expr, path: Path) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):  # a module constant, e.g. fsm.pip.RULE_NETWORK
        value = getattr(_module_of(path), node.id)
        assert isinstance(value, str), (path, node.id)
        return value
    raise AssertionError(f"{path}:{node.lineno}: rule= must be a literal or a module constant")


def _typed_raises() -> list[tuple[str, str, str]]:
    """(where, error class, rule id) for every typed error constructed with rule=..., and
    every default rule id of the typed errors in fsm/errors.py."""
    found: list[tuple[str, str, str]] = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                for kw in node.keywords:
                    if kw.arg == "rule" and node.func.id in ERROR_CLASSES:
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        found.append((where, node.func.id, _rule_value(kw.value, path)))
            if isinstance(node, ast.ClassDef) and node.name in ERROR_CLASSES:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        for arg, default in zip(
                            item.args.kwonlyargs, item.args.kw_defaults, strict=True
                        ):
                            if arg.arg == "rule" and default is not None:
                                where = f"{path.relative_to(ROOT)}:{item.lineno}"
                                found.append((where, node.name, _rule_value(default, path)))
    return found


def test_every_typed_error_the_code_raises_names_an_existing_rule_of_its_class() -> None:
    raises = _typed_raises()
    # The scan must see the states' errors, pip's, and the defaults in fsm/errors.py.
    named = {rule_id for _, _, rule_id in raises}
    assert {"code-missing", "spec-fetch", "worker-failed", "pip-network", "pip-failed",
            "payload-invalid", "store-not-found", "preload-unmounted"} <= named
    for where, cls, rule_id in raises:
        assert rule_id in policy.BY_ID, f"{where}: {cls}(rule={rule_id!r}) names no rule"
        assert policy.BY_ID[rule_id].retriable == ERROR_CLASSES[cls], (
            f"{where}: {cls} is {'retriable' if ERROR_CLASSES[cls] else 'fatal'} but rule "
            f"{rule_id!r} is {policy.BY_ID[rule_id].verdict}"
        )


def test_no_rule_is_dead_every_one_is_raised_by_name_or_claims_something() -> None:
    named = {rule_id for _, _, rule_id in _typed_raises()}
    for r in policy.RULES:
        assert r.id in named or r.matches or r.statuses, f"nothing can ever reach {r.id!r}"


# --- classify, generated --------------------------------------------------------------------

STATES = st.sampled_from(table.WORKING) | st.text(max_size=12)
ANY_STATUS = st.integers(min_value=100, max_value=599)


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
        cls = draw(st.sampled_from([RetriableError, FatalError, FlashError]))
        exc = cls(message, rule=draw(st.sampled_from(STABLE_IDS) | st.text(max_size=10)))
    elif kind == "named":
        r = draw(st.sampled_from(policy.RULES))
        exc = (RetriableError if r.retriable else FatalError)(message, rule=r.id)
    elif kind == "http":
        exc = _HttpError(message, draw(ANY_STATUS | st.integers()))
    elif kind == "status":
        exc = _StatusError(message, draw(ANY_STATUS))
    elif kind == "interrupt":
        exc = Interrupted(draw(st.sampled_from([2, 15])))
    elif kind == "deadline":
        exc = DeadlineExceeded(message)
    else:
        cls = draw(st.sampled_from([StoreUnavailable, StoreAuthError, StoreNotFound, PayloadError]))
        exc = cls(message)
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
    assert decided.claims(state, exc)
    earlier = policy.RULES[: policy.RULES.index(decided)]
    assert not any(r.claims(state, exc) for r in earlier)


@given(STATES, st.sampled_from(policy.RULES), st.text(max_size=20))
def test_a_typed_error_naming_a_rule_is_decided_by_that_rule_in_any_state(
    state: str, named: policy.Rule, message: str
) -> None:
    exc = (RetriableError if named.retriable else FatalError)(message, rule=named.id)
    assert policy.classify(state, exc) is named


@given(STATES, st.sampled_from([RetriableError, FatalError]), st.text(min_size=1, max_size=12))
def test_a_typed_error_naming_an_unknown_rule_is_never_retried(
    state: str, cls: type[FlashError], rule_id: str
) -> None:
    if rule_id in policy.BY_ID:
        return
    assert policy.classify(state, cls("x", rule=rule_id)).id == "unclassified"


@given(STATES, st.sampled_from(PLAIN_TYPES), st.text(max_size=20))
def test_an_error_nobody_classified_is_fatal(
    state: str, cls: type[Exception], message: str
) -> None:
    decided = policy.classify(state, cls(message))
    assert not decided.retriable
    expected = "worker-launch" if state == table.TRAIN and issubclass(cls, OSError) else (
        "unclassified"
    )
    assert decided.id == expected


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
        assert (decided.id, decided.retriable) == ("store-auth", False)
    elif status in (408, 429) or 500 <= status <= 599:
        assert (decided.id, decided.retriable) == ("store-unavailable", True)
    else:
        assert (decided.id, decided.retriable) == ("unclassified", False)


@given(STATES, ANY_STATUS)
def test_a_typed_error_is_not_reclassified_by_a_status_on_its_cause(
    state: str, status: int
) -> None:
    exc = RetriableError("could not read", rule="verify-unreadable")
    exc.__cause__ = _HttpError("503", status)
    assert policy.classify(state, exc).id == "verify-unreadable"


@given(STATES, st.sampled_from([2, 15]))
def test_a_signal_in_any_state_is_retriable_and_the_deadline_fatal(state: str, signum: int) -> None:
    assert policy.classify(state, Interrupted(signum)).id == "interrupted"
    assert policy.classify(state, KeyboardInterrupt()).id == "interrupted"
    assert policy.classify(state, DeadlineExceeded("late")).id == "deadline"


@pytest.mark.parametrize("state", table.WORKING)
def test_a_missing_store_path_is_code_missing_in_fetch_code_and_store_not_found_elsewhere(
    state: str,
) -> None:
    decided = policy.classify(state, StoreNotFound("gone"))
    assert decided.id == ("code-missing" if state == table.FETCH_CODE else "store-not-found")
    assert not decided.retriable


@pytest.mark.parametrize("state", table.WORKING)
def test_store_errors_keep_their_class_in_every_state(state: str) -> None:
    assert policy.classify(state, StoreUnavailable("down")).id == "store-unavailable"
    assert policy.classify(state, StoreAuthError("401")).id == "store-auth"
    assert policy.classify(state, PayloadError("bad")).id == "payload-invalid"


# --- the printed table -----------------------------------------------------------------------


def test_the_printed_table_lists_every_rule_once_in_order_with_its_class() -> None:
    text = policy.render_table()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    rule_rows = rows[: len(policy.RULES)]
    for r, row in zip(policy.RULES, rule_rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[0] == f"`{r.id}`"
        assert cells[-1] == r.verdict
    assert policy.SUCCESS_RULE in text


def test_the_printed_table_shows_every_pip_network_signature() -> None:
    text = policy.render_table()
    pip_row = next(line for line in text.splitlines() if line.startswith("| `pip-network`"))
    for sig in NETWORK_SIGNATURES:
        assert f"`{sig.name}`" in pip_row
        assert f"| `{sig.name}` | {sig.meaning} |" in text
