"""The manifests in ``deploy/`` validate offline and act on every exit status of
``fsm/exits.py`` as its class needs.

The Kubernetes Job is checked with ``kubernetes-validate`` against the API's own schemas
(strict: an unknown field fails), plus the rules the API server enforces that no schema
states (``restartPolicy: Never``, the actions, sorted unique exit codes, no 0 with ``In``);
the AWS Batch job definition with botocore's parameter validator against the Batch service
model's ``RegisterJobDefinition``, plus Batch's documented limits (at most 5
``evaluateOnExit`` entries, ``onExitCode`` digits with an optional trailing ``*``). Then each
status of the table is run through each engine's own matching rules (first match wins) and
must get the action the table names.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import pytest

from fsm import exits

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")
botocore_session = pytest.importorskip("botocore.session")
botocore_validate = pytest.importorskip("botocore.validate")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
JOB = DEPLOY / "kubernetes" / "job.yaml"
BATCH = DEPLOY / "aws-batch" / "job-definition.json"
#: The oldest Kubernetes whose podFailurePolicy is GA (1.31) and the newest the package has.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
K8S_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}
CONTAINER = "runner"


def _job() -> dict[str, Any]:
    value = yaml.safe_load(JOB.read_text())
    assert isinstance(value, dict)
    return value


def _batch() -> dict[str, Any]:
    value = json.loads(BATCH.read_text())
    assert isinstance(value, dict)
    return value


def _k8s_problems(job: dict[str, Any]) -> list[str]:
    """What the API server refuses in a Job's podFailurePolicy that the schema allows."""
    spec = job["spec"]
    pod = spec["template"]["spec"]
    names = {c["name"] for c in pod.get("containers", []) + pod.get("initContainers", [])}
    problems = []
    if pod.get("restartPolicy") != "Never":
        problems.append("podFailurePolicy needs restartPolicy: Never")
    rules = spec["podFailurePolicy"]["rules"]
    if len(rules) > 20:
        problems.append("more than 20 rules")
    for n, rule in enumerate(rules):
        if rule.get("action") not in K8S_ACTIONS:
            problems.append(f"rule {n}: action {rule.get('action')!r}")
        if ("onExitCodes" in rule) == ("onPodConditions" in rule):
            problems.append(f"rule {n}: exactly one of onExitCodes, onPodConditions")
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        values = codes.get("values", [])
        if codes.get("operator") not in ("In", "NotIn"):
            problems.append(f"rule {n}: operator {codes.get('operator')!r}")
        if values != sorted(set(values)) or not 0 < len(values) <= 255:
            problems.append(f"rule {n}: values must be sorted, unique, 1 to 255 of them")
        if codes.get("operator") == "In" and 0 in values:
            problems.append(f"rule {n}: 0 with In")
        if codes.get("containerName") not in (None, *names):
            problems.append(f"rule {n}: containerName names no container")
    return problems


def _k8s_action(job: dict[str, Any], code: int) -> str | None:
    """What the Job controller does when the runner container ends with ``code``: the
    first rule that matches, else Count (the default); None when the pod succeeded."""
    if code == 0:
        return None
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is None or codes.get("containerName") not in (None, CONTAINER):
            continue
        hit = code in codes["values"]
        if hit == (codes["operator"] == "In"):
            return str(rule["action"])
    return "Count"


_ON_EXIT_CODE = re.compile(r"[0-9]+\*?")


def _batch_problems(definition: dict[str, Any]) -> list[str]:
    """Batch's documented limits that the service model does not state."""
    strategy = definition["retryStrategy"]
    entries = strategy.get("evaluateOnExit", [])
    problems = []
    if not 1 <= strategy.get("attempts", 1) <= 10:
        problems.append("attempts must be 1 to 10")
    if len(entries) > 5:
        problems.append("at most 5 evaluateOnExit entries")
    for n, entry in enumerate(entries):
        if entry.get("action", "").upper() not in ("RETRY", "EXIT"):
            problems.append(f"entry {n}: action {entry.get('action')!r}")
        code = entry.get("onExitCode")
        if code is not None and not (_ON_EXIT_CODE.fullmatch(code) and len(code) <= 512):
            problems.append(f"entry {n}: onExitCode {code!r} is digits and an optional *")
    return problems


def _batch_action(definition: dict[str, Any], code: int,
                  reason: str = "Essential container in task exited") -> str | None:
    """What Batch does when the container exits with ``code``: the first entry all of
    whose conditions match (glob patterns), RETRY when none does; None on success."""
    if code == 0:
        return None
    for entry in definition["retryStrategy"]["evaluateOnExit"]:
        conditions = [(entry.get("onExitCode"), str(code)), (entry.get("onReason"), ""),
                      (entry.get("onStatusReason"), reason)]
        if all(pattern is None or fnmatch.fnmatchcase(value, pattern)
               for pattern, value in conditions):
            return str(entry["action"]).upper()
    return "RETRY"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_kubernetes_job_validates_against_the_api_schemas(version: str) -> None:
    kubernetes_validate.validate(_job(), version, strict=True)
    assert _k8s_problems(_job()) == []


def test_the_kubernetes_checks_catch_a_broken_job() -> None:
    """The checks are not vacuous: a misspelt field, an unknown action, unsorted codes."""
    misspelt = _job()
    misspelt["spec"]["podFailurePolicy"]["rules"][1]["onExitCode"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, K8S_VERSIONS[-1], strict=True)
    broken = _job()
    rules = broken["spec"]["podFailurePolicy"]["rules"]
    rules[1]["action"] = "Retry"
    rules[2]["onExitCodes"]["values"] = [75, 73]
    broken["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    assert len(_k8s_problems(broken)) == 3


def test_the_batch_definition_validates_against_the_batch_model() -> None:
    model = botocore_session.get_session().get_service_model("batch")
    shape = model.operation_model("RegisterJobDefinition").input_shape
    validator = botocore_validate.ParamValidator()
    report = validator.validate(_batch(), shape)
    assert not report.has_errors(), report.generate_report()
    assert _batch_problems(_batch()) == []
    misspelt = copy.deepcopy(_batch())
    misspelt["retryStrategy"]["evaluateOnExit"][1]["onExitcode"] = "1"
    assert validator.validate(misspelt, shape).has_errors()
    too_many = copy.deepcopy(_batch())
    too_many["retryStrategy"]["evaluateOnExit"].append({"onExitCode": "9", "action": "EXIT"})
    assert _batch_problems(too_many) == ["at most 5 evaluateOnExit entries"]


@pytest.mark.parametrize("status", exits.TABLE, ids=lambda e: f"{e.code}-{e.name}")
def test_every_status_gets_the_action_its_class_needs_in_both(status: exits.Exit) -> None:
    """Fatal classes fail the Job and end the Batch job; retriable ones retry (in Kubernetes
    without counting against backoffLimit); what a rerun may complete counts."""
    assert _k8s_action(_job(), status.code) == status.kubernetes
    assert _batch_action(_batch(), status.code) == status.batch
    if status.code:  # named by a rule of its own, not left to a default
        named = [r for r in _job()["spec"]["podFailurePolicy"]["rules"]
                 if status.code in r.get("onExitCodes", {}).get("values", [])]
        assert len(named) == 1


def test_a_disruption_is_ignored_in_kubernetes_and_retried_in_batch() -> None:
    """Preemption, eviction, a node drain (DisruptionTarget) or a reclaimed EC2 host are not
    the job's fault: a new pod that does not count, a Batch retry."""
    rules = _job()["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert _batch_action(_batch(), 1, reason="Host EC2 (instance i-0abc) terminated.") == "RETRY"
