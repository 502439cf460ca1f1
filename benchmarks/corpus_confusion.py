"""The console verdict's confusion tables on the public corpus (issue 37), run by hand.

``tests/data/console_corpus.jsonl`` is the tuning half: the signature rows were written
with it in view. ``tests/data/console_heldout.jsonl`` is the held-out half, collected from
threads no tuning case uses and never read while writing rows. Each clear text (``host`` or
``job``, no ``ambiguous`` note) goes to ``policy.judge_worker`` as a failed worker's console
tail after a few training lines, as ``tests/test_console_corpus.py`` does; the tables count
retried and failed by label, on the first attempt and by the second host (the job's fault
seen again on another host: ``fault-follows-job``, CONTRACT section 9).

The wrong cases are listed for the tuning half only: the held-out half's are not to be read
while writing rows (``--list-heldout`` prints them, for a review that ends the tuning).

    python benchmarks/corpus_confusion.py
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsm import policy

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
TRAINING = "".join(f"step {s}/2000 | loss {2.4 - s / 1000:.4f}\n" for s in range(100, 105))


def second_host(rule: policy.Rule, match: policy.ConsoleMatch | None) -> policy.Rule:
    """The verdict when the attempt before failed the same way on another host."""
    fault = policy.fault_of(rule, match)
    before = policy.Previous("run", rule.retriable, "GPU-a", fault)
    return policy.across_attempts(rule, fault, "GPU-b", "run", before)[0]


#: The held-out half's batches, in file order: the first, collected apart while the rows
#: were being recast as families, and the seventh round's held-out half (its threads split
#: by sha256 of the URL, the even ones held out), measured once after that round's rows.
HELDOUT_BATCHES = (("the first held-out batch", 148), ("the seventh round's held-out half", 13))


def table(path: Path, list_wrong: bool, part: slice = slice(None), name: str = "") -> str:
    lines_of = [line for line in path.read_text().splitlines() if line.strip()][part]
    records = [json.loads(line) for line in lines_of]
    clear = [r for r in records if r["label"] in ("host", "job") and "ambiguous" not in r]
    counts: Counter[tuple[str, str]] = Counter()
    wrong = []
    for r in clear:
        rule, match = policy.judge_worker(policy.WorkerFacts(console=TRAINING + r["text"]))
        outcome = "retried" if rule.retriable else "failed"
        counts[(r["label"], outcome)] += 1
        if r["label"] == "job" and not second_host(rule, match).retriable:
            counts[("job", "failed by the 2nd host")] += 1
        if rule.retriable is not (r["label"] == "host"):
            wrong.append(f"  {r['id']}: {r['label']} -> {rule.id} "
                         f"({match.signature.id if match else '-'})")
    host = counts[("host", "retried")] + counts[("host", "failed")]
    job = counts[("job", "retried")] + counts[("job", "failed")]
    lines = [
        f"{path.name}{name}: {len(clear)} clear cases of {len(records)}",
        "| label | retried | failed |",
        "|---|---|---|",
        f"| host ({host}) | {counts[('host', 'retried')]} | {counts[('host', 'failed')]} |",
        f"| job ({job}) | {counts[('job', 'retried')]} | {counts[('job', 'failed')]} |",
        f"host retried {counts[('host', 'retried')] / max(host, 1):.0%}, "
        f"job failed {counts[('job', 'failed')] / max(job, 1):.0%} on the first attempt, "
        f"{counts[('job', 'failed by the 2nd host')] / max(job, 1):.0%} by the second host "
        f"({counts[('job', 'failed by the 2nd host')]})",
    ]
    if list_wrong:
        lines += ["wrong on the first attempt:", *wrong]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(DATA / "console_corpus.jsonl", True), end="\n\n")
    print(table(DATA / "console_heldout.jsonl", "--list-heldout" in sys.argv[1:]))
    start = 0
    for name, size in HELDOUT_BATCHES:
        print("\n" + table(DATA / "console_heldout.jsonl", False, slice(start, start + size),
                           f" ({name})"))
        start += size
