"""The README's failure section is the policy table, generated: a stale copy fails here."""

from __future__ import annotations

from pathlib import Path

from fsm.policy import render_table

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- policy:begin -->"
END = "<!-- policy:end -->"
REGENERATE = (
    "regenerate it: replace the text between the policy markers of README.md with the "
    "output of `python -m fsm policy`"
)


def test_the_readme_failure_section_is_the_current_policy_table() -> None:
    assert README.is_file(), f"{README} is missing; {REGENERATE}"
    text = README.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1, (
        f"README.md needs exactly one {BEGIN} ... {END} block; {REGENERATE}"
    )
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert block.strip("\n") == render_table(), f"the README's policy table is stale; {REGENERATE}"
