"""Pictures of the machine, drawn from the same table the runner executes.

Four formats (``flash-bootstrap diagram --format``):

* ``mermaid``: a ``stateDiagram-v2`` (pure Python; GitHub renders it);
* ``dot``: Graphviz source (pure Python);
* ``svg`` and ``png``: that Graphviz source laid out by pygraphviz (the ``diagrams`` extra:
  ``pip install 'flash-bootstrap[diagrams]'``; its wheel bundles Graphviz, no system
  ``dot`` needed), after checking it against the ``transitions`` GraphMachine.

The four exits every working state but Mark shares (``failed_retriable``,
``failed_fatal``, ``interrupted``, ``deadline_exceeded``, 28 transitions) are drawn
readably: in Mermaid as one edge per state carrying all four names, in Graphviz as one
muted edge from a box around those seven states. Terminal states are drawn as terminal
(``--> [*]`` in Mermaid, double circles in Graphviz).

With a marker (``--marker FILE``) the picture shows the path that attempt took: its
states and transitions highlighted, the state where its fate was decided (the marker's
``state``) labelled with the deciding policy rule (``rule``), and, when the path reached
Mark, the terminal state the marker announces.

``python -m fsm.diagram --write diagrams`` regenerates the committed copies
(``lifecycle.mmd``, ``lifecycle.svg``, ``transitions.json``); ``--policy-doc
docs/policy.md`` refreshes the generated block of the policy page. ``tests/test_diagram.py``
fails when a committed copy no longer matches the machine.

Importing this module is cheap: the standard library and ``fsm.table`` only. pygraphviz
and the diagram extension of ``transitions`` are imported when an image is drawn.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm import table

__all__ = [
    "FORMATS",
    "DiagramUnavailable",
    "InvalidMarker",
    "dot",
    "graph_machine_edges",
    "mermaid",
    "normalise_svg",
    "render",
    "transition_table",
    "write_all",
]

FORMATS: tuple[str, ...] = ("mermaid", "dot", "svg", "png")
INSTALL_HINT = "install flash-bootstrap[diagrams] (pip install 'flash-bootstrap[diagrams]')"

#: Where ``write_all`` puts each rendering.
MERMAID_FILE = "lifecycle.mmd"
SVG_FILE = "lifecycle.svg"
TABLE_FILE = "transitions.json"

REGENERATE = "python -m fsm.diagram --write diagrams --policy-doc docs/policy.md"


class DiagramUnavailable(Exception):
    """The requested picture cannot be drawn here (the CLI prints this one line, exit 2)."""


class InvalidMarker(DiagramUnavailable):
    """The ``--marker`` file is JSON but not an attempt marker.

    A subclass of :class:`DiagramUnavailable` because that is what the CLI turns into one
    line and exit status 2.
    """


FAILURE_LABEL = " / ".join(table.FAILURE_EVENTS)
#: The working states that share the four failure exits (every working state but Mark).
FAILING: tuple[str, ...] = tuple(dict.fromkeys(source for _, source, _ in table.FAILURES))


# --- the attempt a marker describes -----------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What a marker says about the path one attempt took, checked against the table."""

    path: tuple[str, ...]  # the states it passed through, the implied terminal appended
    edges: frozenset[tuple[str, str, str]]  # (source, dest, event) it took
    decided: str | None  # the state where its fate was decided (the marker's ``state``)
    rule: str
    terminal: str | None  # the terminal state it reached, when its path reached Mark
    outcome: str  # ok, retriable or fatal
    title: str
    watchdog: bool


def attempt_of(marker: Mapping[str, Any]) -> Attempt:
    """The path ``marker`` took through the table. Unknown states in its ``path`` are
    skipped, and a step the table does not allow is not drawn: the picture never invents
    a transition."""
    if not isinstance(marker, Mapping):
        raise InvalidMarker(f"--marker: expected a JSON object, got {type(marker).__name__}")
    raw_path = marker.get("path")
    if not isinstance(raw_path, list) or not raw_path:
        raise InvalidMarker("--marker: the marker has no 'path' (a list of state names)")
    path = [s for s in raw_path if isinstance(s, str) and s in table.STATES]
    ok = marker.get("ok") is True
    retriable = marker.get("retriable") is True
    outcome = "ok" if ok else "retriable" if retriable else "fatal"
    rule = _clean(str(marker.get("rule") or ""), 80)
    terminal: str | None = None
    if path and path[-1] == table.MARK:
        terminal = (
            table.SUCCEEDED if ok else table.FAILED_RETRIABLE if retriable else table.FAILED_FATAL
        )
        path.append(terminal)
    edges: set[tuple[str, str, str]] = set()
    for source, dest in itertools.pairwise(path):
        event = _event_between(source, dest, ok, rule, retriable, terminal)
        if event is not None:
            edges.add((source, dest, event))
    state = marker.get("state")
    decided = state if isinstance(state, str) and state in table.STATES else None
    watchdog = marker.get("watchdog") is True
    attempt = marker.get("attempt")
    run_id = marker.get("run_id")
    title = "attempt {}{}: {}{}".format(
        attempt if isinstance(attempt, int) else "?",
        f" of run {_one_line(str(run_id), 80)}" if run_id else "",
        terminal or ("fatal, written by the deadline watchdog" if watchdog else outcome),
        f" (rule {rule})" if rule else "",
    )
    error = marker.get("error")
    if isinstance(error, str) and error.strip():
        title += "\n" + _one_line(error, 110)
    return Attempt(
        path=tuple(path),
        edges=frozenset(edges),
        decided=decided,
        rule=rule,
        terminal=terminal,
        outcome=outcome,
        title=title,
        watchdog=watchdog,
    )


def _event_between(
    source: str, dest: str, ok: bool, rule: str, retriable: bool, terminal: str | None
) -> str | None:
    """The event that took the attempt from ``source`` to ``dest``, or None when the table
    has no such transition."""
    events = [e for e, s, d in table.TRANSITIONS if s == source and d == dest]
    if not events:
        return None
    if source == table.MARK and terminal is not None:
        return table.OUTCOME_EVENT[terminal]
    if dest == table.MARK and not ok:
        # the state before Mark is where a failed attempt failed (the driver's path)
        return _failure_event(rule, retriable)
    progress = [e for e in events if e not in table.FAILURE_EVENTS]
    return progress[0] if progress else None


def _failure_event(rule_id: str, retriable: bool) -> str:
    """The failure exit the driver takes for ``rule_id`` (``fsm.driver.failure_event``)."""
    from fsm.driver import failure_event  # only for a marker: the driver's one mapping
    from fsm.policy import BY_ID

    known = BY_ID.get(rule_id)
    if known is not None:
        return failure_event(known)
    return table.FAILED_RETRIABLE_EVENT if retriable else table.FAILED_FATAL_EVENT


def _clean(text: str, limit: int) -> str:
    """One line of marker text that is safe inside a Mermaid note as well."""
    return re.sub(r"[^\w .,:/()+=@'-]", "?", " ".join(text.split()))[:limit]


def _one_line(text: str, limit: int) -> str:
    """One line of marker text for a Graphviz label (``_q`` escapes it), cut at ``limit``."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --- Mermaid --------------------------------------------------------------------------

_MERMAID_CLASSES = {
    "taken": "fill:#cfe3ff,stroke:#1f5fbf,stroke-width:2px",
    "decided_ok": "fill:#d7f5d7,stroke:#2e8b2e,stroke-width:4px",
    "decided_retriable": "fill:#ffe7bf,stroke:#d9822b,stroke-width:4px",
    "decided_fatal": "fill:#ffd4d4,stroke:#c62828,stroke-width:4px",
}


def mermaid(marker: Mapping[str, Any] | None = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of the table (GitHub renders it).

    Mermaid cannot style the transitions of a state diagram, so a marker highlights the
    states of the path, and a note on the deciding state names the rule.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {table.INITIAL}"]
    for event, source, dest in table.PROGRESS:
        lines.append(f"    {source} --> {dest}: {event}")
    for source in FAILING:
        lines.append(f"    {source} --> {table.MARK}: {FAILURE_LABEL}")
    lines += [f"    {state} --> [*]" for state in table.TERMINAL]
    if marker is not None:
        attempt = attempt_of(marker)
        decided_class = f"decided_{attempt.outcome}"
        used = ["taken", decided_class]
        lines += [f"    classDef {name} {_MERMAID_CLASSES[name]}" for name in used]
        for state in dict.fromkeys(attempt.path):
            if state != attempt.decided:
                lines.append(f"    class {state} taken")
        if attempt.decided is not None:
            lines.append(f"    class {attempt.decided} {decided_class}")
            # the block form: a one-line note may not hold a second colon
            lines += [f"    note right of {attempt.decided}",
                      f"        decided here: {attempt.outcome}"]
            if attempt.rule:
                lines.append(f"        rule {attempt.rule}")
            if attempt.watchdog:
                lines.append("        (deadline watchdog)")
            lines.append("    end note")
    return "\n".join(lines) + "\n"


# --- Graphviz -------------------------------------------------------------------------

FONT = "Helvetica,Arial,sans-serif"
CLUSTER = "cluster_working"
_START = "__start__"
_BLUE = "#1f5fbf"
_MUTED = "#8a8a8a"
_TERMINAL_FILL = {
    table.SUCCEEDED: ("#d7f5d7", "#2e8b2e"),
    table.FAILED_RETRIABLE: ("#ffe7bf", "#d9822b"),
    table.FAILED_FATAL: ("#ffd4d4", "#c62828"),
}
_OUTCOME_COLOR = {"ok": "#2e8b2e", "retriable": "#d9822b", "fatal": "#c62828"}


def _q(text: str) -> str:
    """A double-quoted Graphviz string; newlines become centred line breaks."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def _attrs(attrs: Mapping[str, str]) -> str:
    return "[" + ", ".join(f"{key}={_q(value)}" for key, value in attrs.items()) + "]"


def dot(marker: Mapping[str, Any] | None = None) -> str:
    """The Graphviz source of the machine (what ``svg`` and ``png`` lay out).

    The seven states that share the four failure exits sit in one dashed box, and a
    single muted edge from that box (``ltail``) to Mark carries the four event names.
    """
    attempt = attempt_of(marker) if marker is not None else None
    on_path = set(attempt.path) if attempt else set()
    title = attempt.title if attempt else "flash-bootstrap: the lifecycle of one attempt"
    out = [
        "digraph lifecycle {",
        "    " + _attrs({
            "rankdir": "LR", "compound": "true", "newrank": "true", "fontname": FONT,
            "fontsize": "14", "label": title, "labelloc": "t", "nodesep": "0.35",
            "ranksep": "0.45", "pad": "0.2",
        }).replace("[", "graph [", 1) + ";",
        "    node " + _attrs({
            "shape": "box", "style": "rounded,filled", "fillcolor": "white",
            "color": "black", "fontname": FONT, "fontsize": "12", "margin": "0.15,0.06",
        }).replace("[", '[label="\\N", ', 1) + ";",  # a per-node label would default the rest to ""
        "    edge " + _attrs({"fontname": FONT, "fontsize": "10", "color": "#333333"}) + ";",
        "    " + _q(_START) + " " + _attrs(
            {"shape": "point", "width": "0.14", "style": "filled", "fillcolor": "black"}
        ) + ";",
    ]

    def node(state: str) -> str:
        attrs: dict[str, str] = {}
        if state in table.TERMINAL:
            fill, line = _TERMINAL_FILL[state]
            attrs.update({"shape": "doublecircle", "style": "filled", "fillcolor": fill,
                          "color": line, "fontsize": "11", "margin": "0.02"})
        if state in on_path:
            attrs.update({"color": _BLUE, "penwidth": "2.5"})
            if state not in table.TERMINAL:
                attrs["fillcolor"] = "#cfe3ff"
        if attempt is not None and state == attempt.decided:
            color = _OUTCOME_COLOR[attempt.outcome]
            label = f"{state}\ndecided here: {attempt.outcome}"
            if attempt.rule:
                label += f"\nrule {attempt.rule}"
            if attempt.watchdog:
                label += "\n(deadline watchdog)"
            attrs.update({"label": label, "color": color, "penwidth": "4",
                          "fontcolor": color})
        return f"{_q(state)} {_attrs(attrs)};" if attrs else f"{_q(state)};"

    out.append(f"    subgraph {CLUSTER} {{")
    out.append("        " + _attrs({
        "label": "each state in this box may also fail",
        "labeljust": "l", "style": "dashed,rounded", "color": _MUTED, "fontcolor": "#555555",
        "fontsize": "10",
    }).replace("[", "graph [", 1) + ";")
    out += [f"        {node(state)}" for state in FAILING]
    out.append("    }")
    out += [f"    {node(state)}" for state in table.STATES if state not in FAILING]
    out.append(f"    {{ rank=same; {' '.join(_q(s) for s in table.TERMINAL)} }}")

    taken = attempt.edges if attempt else frozenset()
    on = {"color": _BLUE, "fontcolor": _BLUE, "penwidth": "2.5"}
    start_attrs = on if attempt and attempt.path[:1] == (table.INITIAL,) else {}
    out.append(f"    {_q(_START)} -> {_q(table.INITIAL)}" + (
        f" {_attrs(start_attrs)};" if start_attrs else ";"
    ))
    for event, source, dest in table.PROGRESS:
        attrs = {"label": event}
        if (source, dest, event) in taken:
            attrs.update(on)
        out.append(f"    {_q(source)} -> {_q(dest)} {_attrs(attrs)};")
    # The 28 failure transitions, as one edge from the box. Drawn from its last member so
    # the edge does not pull the layout out of shape; ltail clips it at the box.
    out.append(f"    {_q(FAILING[-2])} -> {_q(table.MARK)} " + _attrs({
        "label": "\n".join(table.FAILURE_EVENTS), "ltail": CLUSTER, "style": "dashed",
        "color": _MUTED, "fontcolor": "#555555", "arrowhead": "empty",
    }) + ";")
    for source, dest, event in sorted(taken):
        if event in table.FAILURE_EVENTS:
            # the failure exit this attempt took, drawn on its own so it can be seen
            out.append(f"    {_q(source)} -> {_q(dest)} {_attrs({'label': event, **on})};")
    out.append("}")
    return "\n".join(out) + "\n"


# --- images (pygraphviz) --------------------------------------------------------------


def _pygraphviz() -> Any:
    try:
        import pygraphviz
    except ImportError as exc:
        raise DiagramUnavailable(f"svg and png need pygraphviz: {INSTALL_HINT}") from exc
    return pygraphviz


def graph_machine_edges() -> set[tuple[str, str, str]]:
    """Every ``(event, source, dest)`` the ``transitions`` GraphMachine draws for the
    machine built from ``fsm.machine.machine_kwargs()``, through the pygraphviz engine.

    The engine is pinned and checked: ``transitions`` silently falls back to another
    engine (a log warning only) when the one asked for is not installed.
    """
    pygraphviz = _pygraphviz()
    from transitions.extensions.diagrams import GraphMachine

    from fsm.machine import machine_kwargs

    class _Model:
        state: str

    model = _Model()
    machine = GraphMachine(model=model, graph_engine="pygraphviz", **machine_kwargs())
    graph = model.get_graph()  # type: ignore[attr-defined]  # bound by GraphMachine
    if not isinstance(graph, pygraphviz.AGraph):
        raise DiagramUnavailable(
            f"transitions drew with {machine.graph_cls.__module__}, not pygraphviz: "
            + INSTALL_HINT
        )
    edges: set[tuple[str, str, str]] = set()
    for edge in graph.edges():
        # the pygraphviz engine merges parallel transitions into one "a | b" label
        for event in str(edge.attr["label"]).split(" | "):
            edges.add((event.strip(), str(edge[0]), str(edge[1])))
    return edges


def _image(marker: Mapping[str, Any] | None, fmt: str) -> bytes:
    """``dot(marker)`` laid out by pygraphviz.

    One path draws both the plain and the highlighted picture. The GraphMachine's own
    pygraphviz drawing has every state as the same box, marks the initial state "active",
    knows no clusters and cannot mark terminal states: restyling its graph into this one
    would mean rewriting most of it, a second copy of the drawing to keep in step with
    ``dot()``. So the GraphMachine is the authority on *what* is drawn: an image is only
    made when the transitions it would draw are exactly the table's.
    """
    pygraphviz = _pygraphviz()
    drawn = graph_machine_edges()
    if drawn != set(table.TRANSITIONS):
        raise DiagramUnavailable(  # pragma: no cover - machine_kwargs() is built from the table
            "the transitions GraphMachine disagrees with fsm.table: "
            f"{sorted(drawn ^ set(table.TRANSITIONS))}"
        )
    graph = pygraphviz.AGraph(string=dot(marker))
    if fmt == "svg":
        return normalise_svg(graph.draw(format="svg", prog="dot"))
    return bytes(graph.draw(format="png", prog="dot", args="-Gdpi=110"))


_GENERATOR_COMMENT = re.compile(rb"<!-- Generated by graphviz version[^>]*-->\n")


def normalise_svg(svg: bytes) -> bytes:
    """The SVG without what varies between Graphviz builds but not between drawings (the
    generator's version comment), so two renders compare byte for byte."""
    return _GENERATOR_COMMENT.sub(b"", svg)


def render(fmt: str, marker: Mapping[str, Any] | None = None) -> bytes:
    """The machine in ``fmt`` (one of :data:`FORMATS`), highlighting ``marker``'s path."""
    if fmt == "mermaid":
        return mermaid(marker).encode()
    if fmt == "dot":
        return dot(marker).encode()
    if fmt in ("svg", "png"):
        return _image(marker, fmt)
    raise DiagramUnavailable(f"unknown diagram format {fmt!r}; one of {', '.join(FORMATS)}")


# --- the committed copies -------------------------------------------------------------


def transition_table() -> dict[str, Any]:
    """The machine as JSON-ready data: states, terminal, events, transitions."""
    return {
        "generated_by": f"{REGENERATE} (do not edit)",
        "initial": table.INITIAL,
        "states": list(table.STATES),
        "working": list(table.WORKING),
        "terminal": list(table.TERMINAL),
        "events": list(table.EVENTS),
        "failure_events": list(table.FAILURE_EVENTS),
        "transitions": [
            {
                "event": event,
                "source": source,
                "dest": dest,
                "kind": "failure" if event in table.FAILURE_EVENTS else "progress",
            }
            for event, source, dest in table.TRANSITIONS
        ],
    }


def renderings(*, images: bool = True) -> dict[str, bytes]:
    """The committed copies of ``diagrams/``, by file name, as a fresh render makes them
    (without the SVG, which needs pygraphviz, when ``images`` is false)."""
    files = {
        MERMAID_FILE: mermaid().encode(),
        TABLE_FILE: (json.dumps(transition_table(), indent=2) + "\n").encode(),
    }
    if images:
        files[SVG_FILE] = render("svg")
    return files


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


def generated_block(text: str, name: str) -> str | None:
    """The text between ``<!-- name:begin -->`` and ``<!-- name:end -->``, or None."""
    match = _block(name).search(text)
    return match["body"] if match else None


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with its ``name`` block replaced by ``body``; ValueError when it has none."""
    if generated_block(text, name) is None:
        raise ValueError(f"no <!-- {name}:begin --> ... <!-- {name}:end --> block")
    return _block(name).sub(lambda m: m["begin"] + body.strip("\n") + "\n" + m["end"], text, 1)


def _block(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(?P<begin><!-- {re.escape(name)}:begin -->\n)(?P<body>.*?)"
        rf"(?P<end><!-- {re.escape(name)}:end -->)",
        re.S,
    )


def refresh_policy_doc(path: Path | str) -> bool:
    """Regenerate the ``policy`` block of ``path`` from ``fsm.policy.render_table()``;
    True when the file changed."""
    from fsm.policy import render_table

    doc = Path(path)
    text = doc.read_text(encoding="utf-8")
    new = replace_block(text, "policy", render_table())
    if new != text:
        doc.write_text(new, encoding="utf-8")
        return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsm.diagram --write diagrams [--policy-doc docs/policy.md]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fsm.diagram", description="Regenerate the committed renderings."
    )
    parser.add_argument("--write", metavar="DIR", type=Path, help="write diagrams/ here")
    parser.add_argument("--policy-doc", metavar="FILE", type=Path,
                        help="refresh this page's <!-- policy:begin/end --> block")
    args = parser.parse_args(argv)
    if args.write is None and args.policy_doc is None:
        parser.error("nothing to do: give --write DIR and/or --policy-doc FILE")
    try:
        changed: Iterable[Path] = write_all(args.write) if args.write is not None else []
        if args.policy_doc is not None and refresh_policy_doc(args.policy_doc):
            changed = [*changed, args.policy_doc]
    except (DiagramUnavailable, OSError, ValueError) as exc:
        print(f"python -m fsm.diagram: {exc}")
        return 2
    for path in changed:
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
