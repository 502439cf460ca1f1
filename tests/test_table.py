"""The transition table, walked as a graph: the lifecycle every run follows."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from types import SimpleNamespace

from conftest import TRAIN_PATH

from fsm import table


def _reachable(start: str) -> set[str]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in table.successors(todo.popleft()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_load_payload() -> None:
    assert _reachable(table.INITIAL) == set(table.STATES)


def test_every_working_state_but_mark_has_the_four_failure_exits_to_mark() -> None:
    for state in table.WORKING:
        if state == table.MARK:
            continue
        for event in table.FAILURE_EVENTS:
            assert (event, state, table.MARK) in table.TRANSITIONS, (state, event)


def test_terminal_states_have_no_exits() -> None:
    for state in table.TERMINAL:
        assert table.allowed(state) == ()


def test_mark_leads_to_exactly_one_terminal_per_outcome() -> None:
    exits = {(e, d) for e, s, d in table.TRANSITIONS if s == table.MARK}
    assert exits == {(event, terminal) for terminal, event in table.OUTCOME_EVENT.items()}
    assert set(table.OUTCOME_EVENT) == set(table.TERMINAL)


def test_mark_has_no_failure_exits_and_is_the_only_way_into_a_terminal() -> None:
    assert not set(table.allowed(table.MARK)) & set(table.FAILURE_EVENTS)
    into_terminal = {s for _, s, d in table.TRANSITIONS if d in table.TERMINAL}
    assert into_terminal == {table.MARK}


def test_the_table_has_no_cycles_so_every_run_ends() -> None:
    # Kahn's algorithm: a DAG sorts completely.
    indegree = {s: 0 for s in table.STATES}
    for s in table.STATES:
        for d in table.successors(s):
            indegree[d] += 1
    ready = [s for s, n in indegree.items() if n == 0]
    ordered = []
    while ready:
        s = ready.pop()
        ordered.append(s)
        for d in table.successors(s):
            indegree[d] -= 1
            if indegree[d] == 0:
                ready.append(d)
    assert len(ordered) == len(table.STATES)


def test_every_path_ends_in_a_terminal_state_within_the_longest_happy_path() -> None:
    longest = {s: 0 for s in table.TERMINAL}

    def depth(state: str) -> int:
        if state not in longest:
            longest[state] = 1 + max(depth(n) for n in table.successors(state))
        return longest[state]

    # the train path: LoadPayload -> InstallExtras -> FetchCode -> ResolveSpec -> Train ->
    # VerifyRemote -> Mark -> terminal
    assert depth(table.INITIAL) == len(TRAIN_PATH) - 1


def test_events_are_unique_per_source_state() -> None:
    pairs = [(e, s) for e, s, _ in table.TRANSITIONS]
    assert len(pairs) == len(set(pairs))


# --- the per-state facts (issue 39): each names states of the table ------------------------


def _progress_order() -> list[str]:
    """The working states in the order the table's progress reaches them."""
    order, todo = [], deque([table.INITIAL])
    while todo:
        state = todo.popleft()
        if state in order or state not in table.WORKING:
            continue
        order.append(state)
        todo.extend(dest for _, src, dest in table.PROGRESS if src == state)
    return order


def test_a_prefetch_starts_only_downloads_of_later_states_and_each_has_its_ahead() -> None:
    from states import AHEAD

    order = _progress_order()
    for starter, joiners in table.PREFETCH.items():
        assert starter in table.WORKING
        for joiner in joiners:
            assert order.index(joiner) > order.index(starter), (starter, joiner)
            assert joiner in AHEAD, f"states.{joiner}: no ahead(ctx) for table.PREFETCH"
    assert set(AHEAD) <= {j for joiners in table.PREFETCH.values() for j in joiners}


def test_every_working_state_says_which_folders_it_writes_and_each_is_measured() -> None:
    assert set(table.WRITES) == set(table.WORKING)
    written = {folder for folders in table.WRITES.values() for folder in folders}
    # the runner measures these at its start; LoadPayload measures the cache
    assert written == {*table.WRITTEN_AT_START, "cache"}
    assert table.PUBLISHES == table.MARK and table.RUN_AFTER_DEADLINE == (table.LOAD_PAYLOAD,)


def test_a_full_disk_is_looked_for_first_where_the_state_writes(tmp_path: Path) -> None:
    """``WRITES`` is the one statement of a state's folders: the driver looks for a full or
    read-only filesystem there first, then in the runner's other folders."""
    from fsm.driver import storage_dirs

    dirs = {"payload": tmp_path / "flash", "code": tmp_path / "runcode",
            "scratch": tmp_path / "scratch", "cache": tmp_path / "hf"}
    settings = SimpleNamespace(payload_path=dirs["payload"] / "payload.json",
                               code_root=dirs["code"], scratch_dir=dirs["scratch"])
    ctx = SimpleNamespace(settings=settings, merged_env=lambda: {"HF_HOME": str(dirs["cache"])})
    for state, folders in table.WRITES.items():
        got = storage_dirs(ctx, state)  # type: ignore[arg-type]
        assert got[:len(folders)] == [dirs[name] for name in folders], state
        assert sorted(got) == sorted(dirs.values()), state
