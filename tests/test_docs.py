"""The documentation under docs/ follows the code: the generated policy table is current,
every state and every rule is documented, links resolve, and the examples run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsm import exits, policy, table
from fsm.policy import doc as policy_doc

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LIFECYCLE = DOCS / "lifecycle.md"


def test_the_generated_policy_block_of_docs_policy_md_is_render_table() -> None:
    block = policy_doc.generated_block((DOCS / "policy.md").read_text(), "policy")
    assert block is not None, "docs/policy.md lost its <!-- policy:begin/end --> markers"
    assert block.strip("\n") == policy.render_table().strip("\n"), (
        "docs/policy.md is stale: run python -m fsm.ops.diagram --doc docs/policy.md"
    )


@pytest.mark.parametrize("page", ["README.md", "docs/contract.md", "deploy/README.md"])
def test_the_exit_status_table_of_the_docs_is_the_one_in_the_code(page: str) -> None:
    """The statuses are one table in ``fsm/exits.py``; the README and the contract carry
    it generated, so they cannot drift from what the runner exits with."""
    block = policy_doc.generated_block((ROOT / page).read_text(), "exits")
    assert block is not None, f"{page} lost its <!-- exits:begin/end --> markers"
    assert block.strip("\n") == exits.render_table(), (
        f"{page}'s exit statuses are stale: run python -m fsm.ops.diagram --doc {page}"
    )


def test_every_exit_status_the_runner_uses_is_in_the_table() -> None:
    """The numbers the rules, the runner and the watchdog exit with come from the table."""
    from fsm import cli
    from fsm.attempt import _watchdog as watchdog
    from fsm.attempt import runner

    codes = {e.code for e in exits.TABLE}
    used = {r.exit_status for r in (*policy.RULES, policy.SUCCESS)} | {
        runner.EXIT_UNUSABLE, runner.EXIT_UNPUBLISHED, runner.EXIT_NOT_OWNER,
        runner.EXIT_INTERNAL, watchdog.EXIT_DEADLINE, cli.EXIT_INTERNAL}
    assert used <= codes
    assert len(codes) == len(exits.TABLE), "two rows share a status"


def test_every_policy_rule_is_documented_in_the_lifecycle() -> None:
    text = LIFECYCLE.read_text()
    missing = [r.id for r in policy.RULES if f"`{r.id}`" not in text]
    assert missing == [], f"docs/lifecycle.md never mentions rules {missing}"
    assert f"`{policy.SUCCESS.id}`" in text


def test_every_state_of_the_table_has_a_section_in_the_lifecycle() -> None:
    headings = re.findall(r"^##+ (\w+)\s*$", LIFECYCLE.read_text(), re.M)
    missing = [state for state in table.STATES if state not in headings]
    assert missing == [], f"docs/lifecycle.md has no section for {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_relative_links_of_the_docs_reach_existing_files_and_headings(page: str) -> None:
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        file = (DOCS / page).parent / path if path else DOCS / page
        assert file.exists(), f"{page} links to {target}, which does not exist"
        if anchor and file.suffix == ".md":
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
            assert anchor in slugs, f"{page} links to {target}: no such heading"


def test_the_lifecycle_links_every_other_page_of_the_docs() -> None:
    text = LIFECYCLE.read_text()
    for page in ("contract.md", "policy.md", "container.md", "testing.md"):
        assert f"]({page}" in text, page


def _examples(page: Path) -> dict[str, str]:
    """The Python blocks of ``page`` that start with a ``# <file name>`` comment."""
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", page.read_text(), re.S)
    return {name: body for name, body in blocks}


def test_the_examples_of_docs_testing_md_run_and_pass(tmp_path: Path) -> None:
    """Both stores: the worker, the local-store test and the local-Hub tests as written."""
    examples = _examples(DOCS / "testing.md")
    assert sorted(examples) == [
        "flash/engine/worker/__main__.py", "test_local_hub.py", "test_local_store.py",
        "test_quota.py",
    ]
    for name, body in examples.items():
        target = tmp_path / ("worker/" + name if name.startswith("flash/") else name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout
