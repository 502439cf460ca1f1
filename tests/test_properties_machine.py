"""The machine under arbitrary events: legal ones move it as the table says, illegal ones
raise ``IllegalEvent`` and change nothing, and nothing ever leaves a terminal state."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fsm import table
from fsm.errors import IllegalEvent
from fsm.machine import RunMachine

NEXT: dict[tuple[str, str], str] = {(e, s): d for e, s, d in table.TRANSITIONS}

#: Names that look like events to ``transitions`` but must never move our machine.
LOOKALIKES = (
    [f"to_{s}" for s in table.STATES]
    + [f"may_{e}" for e in table.EVENTS]
    + [f"is_{s}" for s in table.STATES]
    + ["trigger", "state", "to", "", " ", "__init__", "TRAIN_REQUESTED", "Train_Requested"]
)
ANY_EVENT = st.sampled_from(table.EVENTS) | st.sampled_from(LOOKALIKES) | st.text(max_size=24)


class MachineUnderEvents(RuleBasedStateMachine):
    """A model (the table as a dict) next to the real machine, fed arbitrary events."""

    def __init__(self) -> None:
        super().__init__()
        self.machine = RunMachine()
        self.model = table.INITIAL
        self.terminal: str | None = None

    @initialize(start=st.sampled_from(table.STATES))
    def start_anywhere(self, start: str) -> None:
        self.machine = RunMachine(initial=start)
        self.model = start
        self.terminal = start if start in table.TERMINAL else None

    @precondition(lambda self: self.model not in table.TERMINAL)
    @rule(data=st.data())
    def fire_a_legal_event(self, data: st.DataObject) -> None:
        event = data.draw(st.sampled_from(table.allowed(self.model)))
        assert self.machine.fire(event) == NEXT[(event, self.model)]
        self.model = NEXT[(event, self.model)]
        if self.model in table.TERMINAL:
            self.terminal = self.model

    @rule(event=ANY_EVENT)
    def fire_any_event(self, event: str) -> None:
        before = self.machine.state
        if (event, before) in NEXT:
            assert self.machine.fire(event) == NEXT[(event, before)]
            self.model = NEXT[(event, before)]
            if self.model in table.TERMINAL:
                self.terminal = self.model
            return
        with pytest.raises(IllegalEvent) as info:
            self.machine.fire(event)
        assert self.machine.state == before
        assert (info.value.state, info.value.event) == (before, event)
        assert info.value.allowed == list(table.allowed(before))

    @invariant()
    def agrees_with_the_table(self) -> None:
        assert self.machine.state == self.model
        assert self.machine.allowed() == list(table.allowed(self.model))
        assert self.machine.is_terminal == (self.model in table.TERMINAL)

    @invariant()
    def never_leaves_a_terminal_state(self) -> None:
        if self.terminal is not None:
            assert self.machine.state == self.terminal
            assert self.machine.allowed() == []


TestMachineUnderEvents = MachineUnderEvents.TestCase
