"""Pictures of the machine, drawn by the ``transitions`` GraphMachine from the same table
the runner executes.

``flash-bootstrap diagram --format``: ``mermaid`` (its Mermaid engine, pure Python; GitHub
renders it), or ``dot``, ``svg``, ``png`` (its pygraphviz engine, the ``diagrams`` extra:
``pip install 'flash-bootstrap[diagrams]'``; the wheel bundles Graphviz). Both engines get
the same per-state styles. Added here is only what the engines leave out: the terminal
states' ``--> [*]`` in Mermaid, and in Graphviz the start arrow and one dashed edge, from a
box around the seven states that share them, for the 28 shared failure exits.

With a marker (``--marker FILE``) the picture shows the path that attempt took, the state
where its fate was decided (the marker's ``state``) and the deciding policy rule.
``python -m fsm.ops.diagram --write diagrams`` regenerates the committed copies, which
``tests/test_diagram.py`` compares with a fresh render. Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from fsm import table

INSTALL_HINT = "install flash-bootstrap[diagrams] (pip install 'flash-bootstrap[diagrams]')"
MERMAID_FILE, SVG_FILE, TABLE_FILE = "lifecycle.mmd", "lifecycle.svg", "transitions.json"
REGENERATE = ("python -m fsm.ops.diagram --write diagrams --doc docs/policy.md --doc README.md "
              "--doc docs/contract.md --doc deploy/README.md")


class DiagramUnavailable(Exception):
    """The requested picture cannot be drawn here, or the ``--marker`` file is JSON but not
    an attempt marker (the CLI prints this one line, exit 2)."""


#: The working states that share the four failure exits (every working state but Mark).
FAILING: tuple[str, ...] = tuple(dict.fromkeys(source for _, source, _ in table.FAILURES))


# --- the attempt a marker describes -----------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What a marker says about the path one attempt took, checked against the table."""

    path: tuple[str, ...]  # the states it passed through, the implied terminal appended
    edges: frozenset[tuple[str, str, str]]  # (source, dest, event) it took
    decided: str | None  # the state where its fate was decided (the marker's ``state``)
    outcome: str  # ok, retriable or fatal
    note: tuple[str, ...]  # what the deciding state says: the outcome and the rule
    title: str


def attempt_of(marker: Mapping[str, Any]) -> Attempt:
    """The path ``marker`` took through the table. Unknown states in its ``path`` are
    skipped, and a step the table does not allow is not drawn: the picture never invents
    a transition."""
    if not isinstance(marker, Mapping):
        raise DiagramUnavailable(f"--marker: expected a JSON object, got {type(marker).__name__}")
    raw_path = marker.get("path")
    if not isinstance(raw_path, list) or not raw_path:
        raise DiagramUnavailable("--marker: the marker has no 'path' (a list of state names)")
    from fsm.policy import BY_ID  # only for a marker

    path = [s for s in raw_path if isinstance(s, str) and s in table.STATES]
    ok, retriable = marker.get("ok") is True, marker.get("retriable") is True
    outcome = "ok" if ok else "retriable" if retriable else "fatal"
    rule = _one_line(re.sub(r"[^\w .,:/()+=@'-]", "?", str(marker.get("rule") or "")), 80)
    # an attempt that reached Mark ends in the terminal state of its outcome
    terminal = _TERMINAL[outcome] if path[-1:] == [table.MARK] else None
    path += [terminal] if terminal else []
    # a failed attempt entered Mark by the exit its rule names (the driver's path)
    fallback = table.FAILED_RETRIABLE_EVENT if retriable else table.FAILED_FATAL_EVENT
    failed_by = None if ok else BY_ID[rule].event if rule in BY_ID else fallback
    worker = marker.get("worker")
    # Train left by worker_stalled (host_failed) when the runner stopped the worker as
    # stalled (for its GPUs, the host watch)
    reason = worker.get("reason") if isinstance(worker, Mapping) else None
    stopped = _STOPPED_BY.get(reason) if isinstance(reason, str) else None
    steps = ((s, d, _event_between(s, d, failed_by, stopped)) for s, d in itertools.pairwise(path))
    state, watchdog = marker.get("state"), marker.get("watchdog") is True
    attempt, run_id, error = marker.get("attempt"), marker.get("run_id"), marker.get("error")
    title = "attempt {}{}: {}{}".format(
        attempt if isinstance(attempt, int) else "?",
        f" of run {_one_line(str(run_id), 80)}" if run_id else "",
        terminal or ("fatal, written by the deadline watchdog" if watchdog else outcome),
        f" (rule {rule})" if rule else "",
    )
    if isinstance(error, str) and error.strip():
        title += "\n" + _one_line(error, 110)
    return Attempt(
        path=tuple(path),
        edges=frozenset((s, d, e) for s, d, e in steps if e is not None),
        decided=state if isinstance(state, str) and state in table.STATES else None,
        outcome=outcome,
        note=(f"decided here: {outcome}", *([f"rule {rule}"] if rule else []),
              *(["(deadline watchdog)"] if watchdog else [])),
        title=title,
    )


#: Train's ways out besides the worker's own exit, by the marker's ``worker.reason``.
_STOPPED_BY = {"stalled": table.WORKER_STALLED, "host": table.HOST_FAILED}


def _event_between(
    source: str, dest: str, failed_by: str | None, stopped: str | None
) -> str | None:
    """The event that took the attempt from ``source`` to ``dest`` (None when the table
    has no such transition): ``failed_by`` into Mark; ``stopped`` (``worker_stalled`` or
    ``host_failed``) out of Train for a worker the marker says was stopped as stalled (for
    its GPUs); else the one progress event."""
    events = [e for e, s, d in table.TRANSITIONS if (s, d) == (source, dest)]
    if dest == table.MARK and failed_by in events:
        return failed_by
    if stopped in events:
        return stopped
    return next((e for e in events
                 if e not in table.FAILURE_EVENTS and e not in _STOPPED_BY.values()), None)


def _one_line(text: str, limit: int) -> str:
    """Marker text as one line of at most ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --- the GraphMachine's drawing, either engine -------------------------------------------

FONT = "Helvetica,Arial,sans-serif"
CLUSTER = "cluster_working"
TITLE = "flash-bootstrap: the lifecycle of one attempt"
_BLUE, _MUTED, _PATH_FILL = "#1f5fbf", "#8a8a8a", "#cfe3ff"
_ON = {"color": _BLUE, "fontcolor": _BLUE, "penwidth": "2.5"}
_TERMINAL = {"ok": table.SUCCEEDED, "retriable": table.FAILED_RETRIABLE,
             "fatal": table.FAILED_FATAL}
#: (fill, line) per outcome: the deciding state's outline, the terminal states' colours.
_OUTCOME_COLORS = {"ok": ("#d7f5d7", "#2e8b2e"), "retriable": ("#ffe7bf", "#d9822b"),
                   "fatal": ("#ffd4d4", "#c62828")}
_GRAPH = {  # the pygraphviz engine's graph attributes
    # pygraphviz takes any non-empty string as true: transitions' own "false" makes a
    # strict graph, which cannot hold a second edge between two states
    "name": "lifecycle", "directed": "true", "strict": "", "rankdir": "LR",
    "compound": "true", "newrank": "true", "fontname": FONT, "fontsize": "14",
    "labelloc": "t", "nodesep": "0.35", "ranksep": "0.45", "pad": "0.2",
}


def _node_styles() -> dict[str, dict[str, str]]:
    """The named node styles ``set_node_style`` applies, in Graphviz attributes."""
    node = {
        "default": {"shape": "box", "style": "rounded,filled", "fillcolor": "white",
                    "color": "black", "fontname": FONT, "fontsize": "12", "margin": "0.15,0.06"},
        "path": {"fillcolor": _PATH_FILL, "color": _BLUE, "penwidth": "2.5"},
        "path_terminal": {"color": _BLUE, "penwidth": "2.5"},  # keeps its outcome's fill
    }
    for outcome, (fill, line) in _OUTCOME_COLORS.items():
        node[f"terminal_{outcome}"] = {  # centred: the engine's labels end in "\\l"
            "shape": "doublecircle", "style": "filled", "fillcolor": fill, "color": line,
            "fontsize": "11", "margin": "0.02", "label": "\\N",
        }
        node[f"decided_{outcome}"] = {"color": line, "fontcolor": line, "penwidth": "4"}
    return node


def _css(style: Mapping[str, str]) -> dict[str, str]:
    """A Graphviz node style as a Mermaid ``classDef``."""
    css = {"fillcolor": "fill", "color": "stroke", "fontcolor": "color", "penwidth": "stroke-width"}
    return {css[k]: v + "px" * (k == "penwidth") for k, v in style.items() if k in css}


def _drawing(engine: Literal["mermaid", "pygraphviz"], attempt: Attempt | None) -> Any:
    """The GraphMachine's graph of the table in ``engine``, styled for ``attempt``.
    Graphviz gets the progress transitions only: :func:`graph` draws the shared failure exits
    once. The engine is checked: ``transitions`` silently falls back to another one."""
    from transitions.extensions.diagrams import GraphMachine

    from fsm.machine import machine_kwargs

    mermaid = engine == "mermaid"
    nodes: dict[str, Any] = _node_styles()
    if mermaid:  # Mermaid takes them as classDefs
        nodes = {name: _css(style) for name, style in nodes.items()}

    class Drawing(GraphMachine):
        machine_attributes = GraphMachine.machine_attributes if mermaid else _GRAPH
        style_attributes = {
            "node": nodes,
            "edge": {"default": {"fontname": FONT, "fontsize": "10", "color": "#333333"}},
        }

    kwargs = machine_kwargs()
    if not mermaid:
        kwargs["transitions"] = [t for t in kwargs["transitions"]
                                 if t["trigger"] not in table.FAILURE_EVENTS]
    model = SimpleNamespace()  # transitions binds get_graph to it
    title = attempt.title if attempt else TITLE
    # Mermaid takes the title as YAML front matter, and one line of it
    title = f"title: {json.dumps(title.splitlines()[0])}" if mermaid else _gv(title)
    machine = Drawing(model=model, graph_engine=engine, title=title, **kwargs)
    if machine.graph_cls.__module__ != f"transitions.extensions.diagrams_{engine}":
        raise DiagramUnavailable(
            f"transitions drew with {machine.graph_cls.__module__}, not {engine}: " + INSTALL_HINT
        )
    painter = machine.model_graphs[id(model)]  # transitions' per-state styling
    painter.set_node_style(table.INITIAL, "default")  # a table has no "active" state
    for outcome, state in _TERMINAL.items():
        painter.set_node_style(state, f"terminal_{outcome}")
    for state in attempt.path if attempt else ():
        painter.set_node_style(state, "path_terminal" if state in table.TERMINAL else "path")
    if attempt is not None and attempt.decided is not None:
        painter.set_node_style(attempt.decided, f"decided_{attempt.outcome}")
    return model.get_graph()  # bound by GraphMachine


def mermaid(marker: Mapping[str, Any] | None = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of the table (GitHub renders it). A marker highlights
    the states of its path (Mermaid cannot style transitions) and notes the rule."""
    attempt = attempt_of(marker) if marker is not None else None
    lines = [str(_drawing("mermaid", attempt).draw(None))]
    lines += [f"  {state} --> [*]" for state in table.TERMINAL]  # final states
    if attempt is not None and attempt.decided is not None:
        note = "\n".join(f"    {line}" for line in attempt.note)
        lines.append(f"  note right of {attempt.decided}\n{note}\n  end note")
    return "\n".join(lines) + "\n"


def _gv(text: str) -> str:
    """Label text for Graphviz: backslashes kept, newlines as centred line breaks."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def graph(marker: Mapping[str, Any] | None = None) -> Any:
    """The machine as a ``pygraphviz.AGraph``, with ``marker``'s path on it."""
    try:
        import pygraphviz  # noqa: F401  # transitions' engine needs it
    except ImportError as exc:
        raise DiagramUnavailable(f"dot, svg and png need pygraphviz: {INSTALL_HINT}") from exc
    attempt = attempt_of(marker) if marker is not None else None
    agraph = _drawing("pygraphviz", attempt)
    agraph.add_subgraph(
        FAILING, name=CLUSTER, label="each state in this box may also fail", labeljust="l",
        style="dashed,rounded", color=_MUTED, fontcolor="#555555", fontsize="10",
    )
    agraph.add_subgraph(table.TERMINAL, name="terminal", rank="same")
    agraph.add_node("__start__", label="", shape="point", width="0.14", fillcolor="black")
    agraph.add_edge("__start__", table.INITIAL)
    if attempt is not None and attempt.path[:1] == (table.INITIAL,):
        agraph.get_edge("__start__", table.INITIAL).attr.update(_ON)
    taken = sorted(attempt.edges) if attempt else []
    for source, dest, event in taken:  # while each pair of states has one edge (the engine's)
        if event not in table.FAILURE_EVENTS:
            agraph.get_edge(source, dest).attr.update(_ON)
    # The 28 failure transitions, as one edge from the box. Drawn from one of its last
    # members so the edge does not pull the layout out of shape; ltail clips it at the box.
    agraph.add_edge(
        FAILING[-2], table.MARK, key="failures", label=_gv("\n".join(table.FAILURE_EVENTS)),
        ltail=CLUSTER, style="dashed", color=_MUTED, fontcolor="#555555", arrowhead="empty",
    )
    for source, dest, event in taken:
        if event in table.FAILURE_EVENTS:  # the failure exit taken, drawn on its own
            agraph.add_edge(source, dest, key=event, label=event, **_ON)
    if attempt is not None and attempt.decided is not None:
        label = "\n".join([attempt.decided, *attempt.note])
        agraph.get_node(attempt.decided).attr["label"] = _gv(label)
    return agraph


def dot(marker: Mapping[str, Any] | None = None) -> str:
    """The Graphviz source of :func:`graph` (what ``svg`` and ``png`` lay out)."""
    return str(graph(marker).string())


def normalise_svg(svg: bytes) -> bytes:
    """The SVG without the generator's version comment, which varies between Graphviz
    builds but not between drawings, so two renders compare byte for byte."""
    return re.sub(rb"<!-- Generated by graphviz version[^>]*-->\n", b"", svg)


def render(fmt: str, marker: Mapping[str, Any] | None = None) -> bytes:
    """The machine in ``fmt`` (``mermaid``, ``dot``, ``svg`` or ``png``: the CLI's choices,
    the fleet view's and :func:`renderings`' are no other), highlighting ``marker``'s path."""
    if fmt == "mermaid":
        return mermaid(marker).encode()
    if fmt == "dot":
        return dot(marker).encode()
    drawn = bytes(graph(marker).draw(format=fmt, prog="dot", args="-Gdpi=110" * (fmt == "png")))
    return normalise_svg(drawn) if fmt == "svg" else drawn


# --- the committed copies -------------------------------------------------------------


def transition_table() -> dict[str, Any]:
    """The machine as JSON-ready data: states, terminal, events, transitions."""
    kind = {event: "failure" for event in table.FAILURE_EVENTS}
    return {
        "generated_by": f"{REGENERATE} (do not edit)",
        "initial": table.INITIAL,
        "states": list(table.STATES),
        "working": list(table.WORKING),
        "terminal": list(table.TERMINAL),
        "events": list(table.EVENTS),
        "failure_events": list(table.FAILURE_EVENTS),
        "transitions": [
            {"event": e, "source": s, "dest": d, "kind": kind.get(e, "progress")}
            for e, s, d in table.TRANSITIONS
        ],
    }


def renderings(*, images: bool = True) -> dict[str, bytes]:
    """The committed copies of ``diagrams/``, by file name, as a fresh render makes them
    (without the SVG, which needs pygraphviz, when ``images`` is false)."""
    files = {
        MERMAID_FILE: mermaid().encode(),
        TABLE_FILE: (json.dumps(transition_table(), indent=2) + "\n").encode(),
    }
    return {**files, SVG_FILE: render("svg")} if images else files


def write_all(directory: Path | str) -> list[Path]:
    """Write every rendering into ``directory``; return the files that changed."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, data in renderings().items():
        path = root / name
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
            changed.append(path)
    return changed


#: The generated blocks a page may hold (``fsm.policy.doc``), by name, and what renders each
#: (the policy and the exits imported only when rendered: importing this module is cheap).
BLOCKS: dict[str, Callable[[], str]] = {
    "policy": lambda: importlib.import_module("fsm.policy").render_table(),
    "exits": lambda: importlib.import_module("fsm.exits").render_table(),
    "diagram": lambda: "```mermaid\n" + mermaid() + "```\n",
}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsm.ops.diagram --write diagrams [--doc README.md --doc docs/policy.md ...]``."""
    from fsm.policy.doc import refresh_doc

    parser = argparse.ArgumentParser(
        prog="python -m fsm.ops.diagram", description="Regenerate the committed renderings."
    )
    parser.add_argument("--write", metavar="DIR", type=Path, help="write diagrams/ here")
    parser.add_argument("--doc", "--policy-doc", metavar="FILE", type=Path, action="append",
                        default=[], dest="docs",
                        help=f"refresh this page's generated blocks ({', '.join(BLOCKS)}); "
                             "repeat for several pages")
    args = parser.parse_args(argv)
    if args.write is None and not args.docs:
        parser.error("nothing to do: give --write DIR and/or --doc FILE")
    try:
        changed = write_all(args.write) if args.write is not None else []
        changed += [doc for doc in args.docs if refresh_doc(doc, BLOCKS)]
    except (DiagramUnavailable, OSError, ValueError) as exc:
        print(f"python -m fsm.ops.diagram: {exc}")
        return 2
    for path in changed:
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
