"""The transition table under generated walks: every run, however it goes, ends in one terminal."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fsm import policy, rules, table
from fsm.machine import RunMachine

#: The working states that can fail (Mark has no failure exits).
FAILING_STATES = tuple(s for s in table.WORKING if s != table.MARK)

#: No run takes more steps than there are working states: each is visited at most once.
MAX_STEPS = len(table.WORKING)


def _walk(data: st.DataObject, start: str = table.INITIAL) -> list[tuple[str, str, str]]:
    """A random walk over the table from ``start``: (state, event, next) per step, until
    no event is allowed or the step budget is spent."""
    steps: list[tuple[str, str, str]] = []
    state = start
    while table.allowed(state) and len(steps) <= MAX_STEPS:
        event = data.draw(st.sampled_from(table.allowed(state)), label=f"event in {state}")
        nxt = {e: d for e, s, d in table.TRANSITIONS if s == state}[event]
        steps.append((state, event, nxt))
        state = nxt
    return steps


def _end(steps: list[tuple[str, str, str]], start: str = table.INITIAL) -> str:
    return steps[-1][2] if steps else start


@given(st.data())
def test_every_random_walk_ends_in_a_terminal_state_within_the_step_bound(
    data: st.DataObject,
) -> None:
    steps = _walk(data)
    assert len(steps) <= MAX_STEPS
    assert _end(steps) in table.TERMINAL


@given(st.sampled_from(table.STATES), st.data())
def test_a_walk_from_any_state_ends_in_a_terminal_and_never_revisits_a_state(
    start: str, data: st.DataObject
) -> None:
    steps = _walk(data, start)
    visited = [start] + [nxt for _, _, nxt in steps]
    assert len(visited) == len(set(visited)), f"cycle: {visited}"
    assert _end(steps, start) in table.TERMINAL


@given(st.data())
def test_every_walk_reaches_its_terminal_through_mark_exactly_once_with_the_matching_event(
    data: st.DataObject,
) -> None:
    steps = _walk(data)
    into_mark = [i for i, (_, _, nxt) in enumerate(steps) if nxt == table.MARK]
    assert len(into_mark) == 1
    state, event, terminal = steps[-1]
    assert state == table.MARK
    assert into_mark[0] == len(steps) - 2
    assert table.OUTCOME_EVENT[terminal] == event


@given(st.sampled_from(table.STATES))
def test_every_state_is_reachable_and_can_still_reach_a_terminal(state: str) -> None:
    def reachable(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in table.successors(todo.pop()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert state in reachable(table.INITIAL)
    assert reachable(state) & set(table.TERMINAL), f"{state} is a trap"


@given(
    st.sampled_from([s for s in table.WORKING if s != table.MARK]),
    st.sampled_from(table.FAILURE_EVENTS),
)
def test_every_working_state_but_mark_fails_four_ways_into_mark(state: str, event: str) -> None:
    assert event in table.allowed(state)
    assert RunMachine(initial=state).fire(event) == table.MARK


def _applies(r: rules.Rule) -> st.SearchStrategy[tuple[rules.Rule, str]]:
    states = FAILING_STATES if r.where == rules.ANY else (r.where,)
    return st.tuples(st.just(r), st.sampled_from(states))


@given(st.sampled_from(policy.RULES).flatmap(_applies))
def test_every_rule_leaves_each_state_it_applies_in_for_mark_by_its_event(
    rule_and_state: tuple[rules.Rule, str],
) -> None:
    r, state = rule_and_state
    assert r.event in table.FAILURE_EVENTS
    assert r.event in table.allowed(state)
    assert RunMachine(initial=state).fire(r.event) == table.MARK


def test_the_success_rule_leaves_its_state_for_mark_by_its_event() -> None:
    assert table.COMPLETION_CONFIRMED not in table.FAILURE_EVENTS
    assert RunMachine(initial=policy.SUCCESS.where).fire(policy.SUCCESS.event) == table.MARK


@given(st.sampled_from(table.TERMINAL), st.sampled_from(table.EVENTS))
def test_a_terminal_state_allows_no_event(terminal: str, event: str) -> None:
    assert table.allowed(terminal) == ()
    assert event not in RunMachine(initial=terminal).allowed()


@given(st.sampled_from(table.TERMINAL))
def test_mark_leads_to_each_terminal_by_exactly_one_event(terminal: str) -> None:
    events = [e for e, s, d in table.TRANSITIONS if s == table.MARK and d == terminal]
    assert events == [table.OUTCOME_EVENT[terminal]]


@given(st.data())
def test_the_machine_follows_every_walk_of_the_table(data: st.DataObject) -> None:
    steps = _walk(data)
    machine = RunMachine()
    for state, event, nxt in steps:
        assert machine.state == state
        assert machine.allowed() == list(table.allowed(state))
        assert machine.fire(event) == nxt
    assert machine.is_terminal
