"""The transitions machine built from the table: loud on illegal events, final at the end."""

from __future__ import annotations

import pytest

from fsm import table
from fsm.errors import IllegalEvent
from fsm.machine import RunMachine


def test_an_illegal_event_raises_naming_state_event_and_allowed_events_and_changes_nothing() -> (
    None
):
    machine = RunMachine()
    with pytest.raises(IllegalEvent) as info:
        machine.fire(table.WORKER_EXITED)
    assert machine.state == table.LOAD_PAYLOAD
    message = str(info.value)
    assert "LoadPayload" in message
    assert "worker_exited" in message
    assert "train_requested" in message
    assert info.value.allowed == list(table.allowed(table.LOAD_PAYLOAD))


def test_an_unknown_event_is_the_same_typed_error() -> None:
    machine = RunMachine()
    with pytest.raises(IllegalEvent):
        machine.fire("no_such_event")
    assert machine.state == table.LOAD_PAYLOAD


def test_there_are_no_automatic_to_state_triggers() -> None:
    machine = RunMachine()
    with pytest.raises(IllegalEvent):
        machine.fire("to_Succeeded")
    assert machine.state == table.LOAD_PAYLOAD


def test_the_happy_train_path_runs_through_the_machine() -> None:
    machine = RunMachine()
    for event in (
        table.TRAIN_REQUESTED,
        table.EXTRAS_INSTALLED,
        table.CODE_FETCHED,
        table.SPEC_RESOLVED,
        table.WORKER_EXITED,
        table.COMPLETION_CONFIRMED,
        table.MARKED_SUCCEEDED,
    ):
        machine.fire(event)
    assert machine.state == table.SUCCEEDED
    assert machine.is_terminal


@pytest.mark.parametrize("terminal", table.TERMINAL)
def test_nothing_leaves_a_terminal_state(terminal: str) -> None:
    machine = RunMachine(initial=terminal)
    for event in table.EVENTS:
        with pytest.raises(IllegalEvent):
            machine.fire(event)
        assert machine.state == terminal
