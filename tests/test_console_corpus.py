"""The console verdict on real failure texts (issue 24): what failed workers printed, as
users posted it in public issue threads, labelled by what each thread settled.

``tests/data/console_corpus.jsonl`` holds the texts (``tests/data/README.md`` says how they
were chosen). Every text goes to ``policy.judge_worker`` as a failed worker's console tail,
after a few lines of ordinary training output, and through the real runner (a real worker
process printing it): a host fault (``label: host``) must be retried on a fresh host
(``worker-host-fault``), a job fault must fail the run (``worker-failed``). Texts whose
words are a host fault in one thread and a job fault in another carry an ``ambiguous``
note and are left out of the class assertions: the console cannot tell them apart, the
GPUs' own health has to. The ambiguous families (``label: ambiguous``: shared memory, a full
disk, a driver too old, NCCL timeouts) are decided as ``FAMILY_DECISION`` says, the policy's
``HOST_EVIDENCE`` rows, whatever the single thread settled.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import TRAIN_PATH, Layout
from hypothesis import given
from hypothesis import strategies as st

from fsm import policy, rules
from fsm.policy import CONSOLE_WINDOW_LINES, WorkerFacts

CORPUS_PATH = Path(__file__).parent / "data" / "console_corpus.jsonl"
CORPUS: list[dict[str, Any]] = [
    json.loads(line) for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if line
]
#: The held-out half (issue 37): threads no tuning case uses, collected apart and never read
#: while writing signature rows. Only its form is tested here; what the verdict makes of
#: it is measured by ``benchmarks/corpus_confusion.py`` and reported, not tuned on.
HELDOUT_PATH = Path(__file__).parent / "data" / "console_heldout.jsonl"
HELDOUT: list[dict[str, Any]] = [
    json.loads(line) for line in HELDOUT_PATH.read_text(encoding="utf-8").splitlines() if line
]
BY_ID = {record["id"]: record for record in CORPUS}
CLEAR = [record for record in CORPUS
         if "ambiguous" not in record and record["label"] != "ambiguous"]
AMBIGUOUS = [record for record in CORPUS if "ambiguous" in record]
#: The ambiguous families: the thread's own cause is kept (``cause``), the class is the
#: policy's decision for the family (a record's ``expect`` overrides it, saying ``why``).
FAMILIES = [record for record in CORPUS if record["label"] == "ambiguous"]

LABELS = {"host", "job", "ambiguous"}
HOST_FAMILIES = {"gpu", "driver", "interconnect"}
#: The policy's decision for each ambiguous family with no host evidence beside the console
#: (``fsm.policy.HOST_EVIDENCE``: a disk short before setup would make ``disk-full`` the
#: host's; the GPUs' change since the start makes anything the host's).
FAMILY_DECISION = {"shm": "job", "disk-full": "job", "driver-too-old": "host",
                   "nccl-timeout": "job"}
KEYS = {"id", "source", "label", "family", "settled", "text"}
OPTIONAL_KEYS = {"ambiguous", "cause", "expect", "why"}
#: A thread: a GitHub issue or pull request.
SOURCE = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/\d+")
#: How an ambiguous note names another thread: owner/repo#number.
THREAD_REF = re.compile(r"\b[\w.-]+/[\w.-]+#\d+")

#: What a worker prints while it trains, before it fails.
TRAINING = "".join(
    f"step {step}/2000 | loss {2.4 - step / 1000:.4f} | lr 3.0e-04 | 41,200 tok/s\n"
    for step in range(100, 105)
)

#: What the runner's own tests bound a whole attempt by: far above what any takes.
RUN_TIMEOUT_S = 30


def verdict(text: str) -> tuple[rules.Rule, policy.ConsoleMatch | None]:
    """The rule for a worker that printed some training lines, then ``text``, and died."""
    return policy.judge_worker(WorkerFacts(console=TRAINING + text))


def second_verdict(text: str) -> rules.Rule:
    """The rule when the attempt before, on another host, failed with the same words: the
    fault followed the job (CONTRACT section 9) unless something else decides."""
    rule, match = verdict(text)
    fault = policy.fault_of(rule, match)
    before = policy.Previous("run-1", rule.retriable, "GPU-host-a", fault)
    return policy.across_attempts(rule, fault, "GPU-host-b", "run-1", before)[0]


def retried_first(match: policy.ConsoleMatch | None) -> bool:
    """Whether a job's fault may be retried once: its words name no cause (a weak
    retriable row: an application-class Xid, an unspecified launch failure), so one attempt
    cannot tell it from the host's; the second attempt, on another host, ends it."""
    return match is not None and match.signature.weak and match.signature.retriable


def lines_of(text: str) -> set[str]:
    return {line.strip() for line in re.split(r"\r\n|\r|\n", text)}


# --- the corpus itself ----------------------------------------------------------------


@pytest.mark.parametrize("record", CORPUS + HELDOUT,
                         ids=[record["id"] for record in CORPUS]
                         + [f"heldout-{record['id']}" for record in HELDOUT])
def test_every_record_names_its_thread_its_label_and_why(record: dict[str, Any]) -> None:
    assert KEYS <= set(record) <= KEYS | OPTIONAL_KEYS, sorted(record)
    assert re.fullmatch(r"[a-z0-9]+(?:-[a-z0-9]+)+", record["id"]), record["id"]
    assert SOURCE.fullmatch(record["source"]), record["source"]
    assert record["label"] in LABELS
    if record["label"] == "host":
        assert record["family"] in HOST_FAMILIES
    elif record["label"] == "ambiguous":
        assert record["family"] in FAMILY_DECISION
        assert record["cause"] in ("host", "job"), "what the thread settled"
        if "expect" in record:
            assert record["expect"] in ("host", "job") and record["why"].strip()
    else:
        assert record["family"] == "job"
    assert record["settled"].strip() and "\n" not in record["settled"]
    assert record["text"].strip() and record["text"].endswith("\n")
    if "ambiguous" in record:
        assert record["ambiguous"].strip(), "an ambiguous record says why"


def test_the_held_out_half_shares_no_thread_with_the_tuning_half() -> None:
    tuning = {record["source"] for record in CORPUS}
    held = [record["source"] for record in HELDOUT]
    assert len(held) == len(set(held)), "one case per thread"
    assert not tuning & set(held)
    assert len({record["id"] for record in CORPUS + HELDOUT}) == len(CORPUS) + len(HELDOUT)
    assert len(CORPUS) + len(HELDOUT) >= 250
    labels = Counter(record["label"] for record in HELDOUT)
    assert labels["host"] >= 40 and labels["job"] >= 40, labels


def expected(record: dict[str, Any]) -> str:
    """``host`` or ``job``: the class the runner must give the record's text alone."""
    if record["label"] != "ambiguous":
        return str(record["label"])
    return str(record.get("expect") or FAMILY_DECISION[record["family"]])


def test_the_corpus_is_large_and_varied() -> None:
    assert len(BY_ID) == len(CORPUS), "ids are unique"
    assert len(CORPUS) >= 150, len(CORPUS)
    families = Counter(record["family"] for record in CLEAR)
    assert set(families) == HOST_FAMILIES | {"job"}, families
    assert all(count >= 10 for count in families.values()), families
    ambiguous = Counter(record["family"] for record in FAMILIES)
    assert set(ambiguous) == set(FAMILY_DECISION), ambiguous
    assert all(count >= 6 for count in ambiguous.values()), ambiguous
    sources = Counter(SOURCE.fullmatch(r["source"]).group(0).split("/")[3]  # type: ignore[union-attr]
                      for r in CORPUS)
    assert len(sources) >= 20, sources  # many trackers, not one


def test_every_ambiguous_record_points_at_a_thread_that_settled_the_other_way() -> None:
    """An ambiguity is shown, not asserted: where the note names a corpus record, that
    record carries the other label."""
    by_source = {record["source"].removeprefix("https://github.com/"): record
                 for record in CORPUS}
    for record in AMBIGUOUS:
        for ref in THREAD_REF.findall(record["ambiguous"]):
            owner_repo, number = ref.split("#")
            for kind in ("issues", "pull"):
                other = by_source.get(f"{owner_repo}/{kind}/{number}")
                if other is not None and other["id"] != record["id"]:
                    assert other["label"] != record["label"] or "ambiguous" in other, (
                        record["id"], other["id"])


# --- the verdict on every text -------------------------------------------------------


@pytest.mark.parametrize("record", CLEAR, ids=[record["id"] for record in CLEAR])
def test_the_console_verdict_matches_what_the_thread_settled(record: dict[str, Any]) -> None:
    rule, match = verdict(record["text"])
    if record["label"] == "host":
        assert rule is rules.WORKER_HOST_FAULT and rule.retriable, (
            f"{record['id']} ({record['source']}): a host fault ended {rule.id}, fatal; "
            f"settled: {record['settled']}")
        assert match is not None and match.signature.retriable
        assert match.signature.blame in HOST_FAMILIES
        assert any(match.line in line for line in lines_of(record["text"]))
    elif retried_first(match):
        assert rule is rules.WORKER_HOST_FAULT
        assert second_verdict(record["text"]) is rules.FAULT_FOLLOWS_JOB, record["id"]
    else:
        assert rule is rules.WORKER_FAILED and not rule.retriable, (
            f"{record['id']} ({record['source']}): a job fault ended {rule.id} via "
            f"{match.signature.id if match else None}, retried; settled: {record['settled']}")
        assert match is None or not match.signature.retriable


@pytest.mark.parametrize("record", FAMILIES, ids=[record["id"] for record in FAMILIES])
def test_an_ambiguous_familys_text_gets_the_familys_decision(record: dict[str, Any]) -> None:
    rule, match = verdict(record["text"])
    host = expected(record) == "host"
    assert rule.retriable is host, (
        f"{record['id']} ({record['family']}): decided {'host' if host else 'job'}, ended "
        f"{rule.id} via {match.signature.id if match else None}")
    assert rule is (rules.WORKER_HOST_FAULT if host else rules.WORKER_FAILED)


@pytest.mark.parametrize("record", [r for r in FAMILIES if r["family"] == "disk-full"],
                         ids=lambda r: r["id"])
def test_a_full_disk_is_the_hosts_only_when_it_was_short_before_setup(
    record: dict[str, Any]
) -> None:
    rule, match = policy.judge_worker(WorkerFacts(console=TRAINING + record["text"],
                                                  disk_short_at_start=True))
    if match is not None and match.signature.id == "disk-full":
        assert rule is rules.WORKER_HOST_FAULT
    else:  # the words name no full disk: the evidence has nothing to decide
        assert rule is verdict(record["text"])[0]


def test_the_corpus_summary_every_host_text_retried_every_job_text_failed() -> None:
    """The confusion table of the clear texts, by label and family, in the message."""
    table: Counter[tuple[str, str, str]] = Counter()
    wrong: list[str] = []
    once = 0
    for record in CLEAR:
        rule, match = verdict(record["text"])
        outcome = "retried" if rule.retriable else "failed"
        if rule.retriable and record["label"] == "job" and retried_first(match):
            once += 1
            outcome = "failed on the 2nd host"
            rule = second_verdict(record["text"])
        table[(record["label"], record["family"], outcome)] += 1
        if rule.retriable is not (record["label"] == "host"):
            wrong.append(f"{record['id']} -> {rule.id} ({match.signature.id if match else '-'})")
    host = [r for r in CLEAR if r["label"] == "host"]
    job = [r for r in CLEAR if r["label"] == "job"]
    retried = sum(table[("host", f, "retried")] for f in HOST_FAMILIES)
    failed = table[("job", "job", "failed")] + once
    report = (
        f"host texts retried {retried}/{len(host)}, job texts failed {failed}/{len(job)} "
        f"({once} on the second host); "
        + ", ".join(f"{label}/{family} {outcome}: {n}"
                    for (label, family, outcome), n in sorted(table.items()))
        + ("; wrong: " + "; ".join(wrong) if wrong else "")
    )
    decided = Counter((r["family"], expected(r), "retried" if verdict(r["text"])[0].retriable
                       else "failed") for r in FAMILIES)
    report += "; ambiguous families: " + ", ".join(
        f"{family} (decided {decision}) {outcome}: {n}"
        for (family, decision, outcome), n in sorted(decided.items()))
    print(report)
    assert retried == len(host) and failed == len(job), report
    # The exception, not the rule: issue 37's goal has at least 95 % of job faults failed on
    # the first attempt.
    assert once <= 0.05 * len(job), "a job fault retried once is the exception, not the rule"


def test_the_ambiguous_texts_are_the_known_ones() -> None:
    """Left out of the class assertions on purpose, each for its note's reason; a new one
    is a decision to make, not an accident."""
    assert {record["id"] for record in AMBIGUOUS} == {
        "nccl-426-ib-error-12-roce",
        "marian-251-gpu-lost-after-data",
        "sist-42-driver-mismatch-container",
        "comosvc-6-no-gpus-hardcoded",
        "mineru-381-launch-failure-bad-card",
        "pytorch-2567-launch-failure-fixed",
        "caffe-183-segv-libcuda-driver",
        "waifu2x-139-segv-libcuda-driver",
        "accelerate-260-segv-libcuda-teardown",
        "pytorch-51382-xid13-faulty-device",
        "k8s-device-plugin-267-ecc-shows-as-oom",
        "ultralytics-7716-launch-failure-after-suspend",
        "ray-37225-no-cuda-gpus-tune-resources",
        "pytorch-105721-nvidia-smi-hang-runner",
        # the second tuning batch (issue 37)
        "biop-desktop-27-nvml-mismatch-image-libs",
        "nvidia-docker-528-driver-installed-in-dockerfile",
        "numba-5793-cuinit-no-device-visible-devices-minus-one",
        "jax-20588-cuda-not-initialized-compute-capability",
        "darknet-5547-illegal-instruction-multi-gpu-hardware",
        "k8s-device-plugin-243-ecc-cannot-allocate-memory",
        "vllm-25937-symmetric-memory-rendezvous-multicast-hw",
        # the third tuning batch (issue 37)
        "accelerate-236-invalid-device-context-k40m-not-initialised",
        "nicehash-quickminer-434-illegal-memory-access-unstable-oc",
        "manylinux-cuda-5-libnvidia-ml-load-failed-driver-in-image",
        "bigdata-108-nvidia-smi-no-driver-plain-docker",
        "gorgonia-cu-2-cuinit-unknown-nvidia-uvm-not-loaded",
        "nvidia-docker-284-nvml-insufficient-permissions-host-driver",
        "jax-20722-cuda-backend-not-initialized-wrong-jaxlib",
        "pytorch-112950-nvmlinit-assert-server-reboot",
        "nvidia-docker-74-could-not-load-nvml-library",
        # the fourth tuning batch (issue 37)
        "nccl-2013-ibv-modify-qp-timeout-cross-nic",
        "nccl-778-ibv-reg-dmabuf-mr-not-supported",
        "amazon-dsstne-26-no-cuda-device-wrong-instance",
        # the sixth tuning batch (issue 37)
        "lwa-issues-117-gpu-node-mce-uncorrectable-dimm",
        "pytorch-80802-segfault-faulty-ram-removed",
        "shapetexturedebiased-12-no-cuda-gpus-gpu-id-arg",
        # the seventh tuning batch (issue 37)
        "reward-learning-rl-15-ray-trial-cuinit-no-device",
        "awsome-distributed-ai-203-ofi-register-memory",
    }


#: A line of ordinary output: no signature shows in it.
NOISE = st.one_of(
    st.sampled_from([
        "step 120/1000 | loss 2.3141 | lr 3.0e-04 | 41,200 tok/s",
        "[rank0]: saving checkpoint to /runcode/ckpt/step_120",
        "gpu-node-3:1234:1290 [0] NCCL INFO Channel 00/32 :    0   1   2   3",
        "wandb: Run history: train/loss ▇▆▅▄▃▂▁",
        " 45%|████▌     | 450/1000 [03:07<03:49,  2.40it/s]",
    ]),
    st.text(st.characters(exclude_categories=["Cs", "Cc", "Zl", "Zp"]), min_size=1,
            max_size=80),
).filter(lambda s: bool(s.strip()) and policy.console_verdict(s) is None)


@given(st.sampled_from(CLEAR + FAMILIES), st.lists(NOISE, max_size=40),
       st.lists(NOISE, max_size=40))
def test_unrelated_lines_before_or_after_never_flip_a_verdict(
    record: dict[str, Any], before: list[str], after: list[str]
) -> None:
    """Within the window, lines that show no fault neither hide a host fault nor make a
    job fault look like the host's."""
    text = "".join(line + "\n" for line in before) + record["text"] + "".join(
        line + "\n" for line in after)
    assert len(re.split(r"\r\n|\r|\n", TRAINING + text)) <= CONSOLE_WINDOW_LINES
    rule, _ = verdict(text)
    # A job's fault in words that name no cause is retried once, alone or among other lines.
    host = expected(record) == "host" or retried_first(verdict(record["text"])[1])
    assert rule.retriable is host, record["id"]


# --- through the real runner -----------------------------------------------------------

#: One text per family, through the runner as a process: each needed a signature the
#: issue found missing (NVML unreachable, no driver, an IB completion error) or is a job
#: fault that looks like NCCL's.
THROUGH_THE_RUNNER = [
    "cs336-1-nvml-device-handle",          # gpu
    "gcp-18-smi-no-driver-kernel",         # driver
    "nccl-1405-ib-status-12-new-format",   # interconnect
    "dfine-289-duplicate-gpu",             # job
]

#: A worker that trains a few steps, prints the thread's text exactly, and dies.
PRINTING_WORKER = """
    for step in range(3):
        print(f"step {{step}} | loss {{2.5 - step / 10:.4f}} | lr 3.0e-04", flush=True)
    sys.stdout.write({text!r})
    sys.stdout.flush()
    sys.exit(1)
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The runner's environment: its OOM count in a file of the test's (no OOM kill)."""
    events = tmp_path / "memory.events"
    events.write_text("oom 0\noom_kill 0\n")
    return {"FLASH_MEMORY_EVENTS": str(events)}


DECIDED = CLEAR + FAMILIES


@pytest.mark.parametrize("record", DECIDED, ids=[record["id"] for record in DECIDED])
def test_every_corpus_text_printed_by_a_real_worker_ends_in_its_class(
    layout: Layout, record: dict[str, Any]
) -> None:
    """The runner (in this process, signals aside) supervises a real worker that prints the
    text and dies: the attempt's class is the text's."""
    layout.write_worker(PRINTING_WORKER.format(text=record["text"]))
    events = layout.root / "memory.events"
    events.write_text("oom 0\noom_kill 0\n")
    outcome = layout.run(environ={"FLASH_MEMORY_EVENTS": str(events)})
    # A job's fault in words that name no cause is retried once; its second host ends it
    # (tests/test_across_attempts.py runs that through two hosts).
    host = expected(record) == "host" or retried_first(verdict(record["text"])[1])
    failure = outcome.context.failure
    assert failure is not None and failure.state == "VerifyRemote", outcome.reason
    assert (failure.rule.id, failure.rule.retriable) == (
        ("worker-host-fault", True) if host else ("worker-failed", False)), (
        f"{record['id']} ({record['source']}): {outcome.reason}")


@pytest.mark.parametrize("record_id", THROUGH_THE_RUNNER)
def test_a_corpus_text_on_a_real_workers_console_decides_the_marker(
    layout: Layout, env: dict[str, str], record_id: str
) -> None:
    record = BY_ID[record_id]
    layout.write_worker(PRINTING_WORKER.format(text=record["text"]))
    layout.write_payload()

    proc: subprocess.CompletedProcess[bytes] = layout.cli(
        *layout.run_args(), env=env, timeout=RUN_TIMEOUT_S)

    marker = layout.marker()
    stderr = proc.stderr.decode("utf-8", "replace")
    assert marker is not None, stderr[-3000:]
    host = record["label"] == "host"
    expected = policy.console_verdict(TRAINING + record["text"])
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, host, "worker-host-fault" if host else "worker-failed", "VerifyRemote"
    ), stderr[-3000:]
    assert proc.returncode == (75 if host else 1), stderr[-3000:]
    assert marker["path"] == [*TRAIN_PATH[:-2], "Mark"]
    if host:
        assert expected is not None
        assert marker["host_fault"] == {"signature": expected.signature.id,
                                        "line": expected.line}
        assert "job_fault" not in marker
    else:
        assert "host_fault" not in marker
        assert expected is None or not expected.signature.retriable
    console = layout.artifact("console_sft.txt").read_text()
    assert record["text"].splitlines()[-1] in console  # the stored tail holds the text
