"""The Kubernetes recipes (examples/kubernetes/*.yaml, shown in docs/kubernetes.md).

Each manifest is checked against the published schema of its resource, strictly (an unknown
field fails: ``tests/kubernetes_schemas.py``, schemas stored in ``tests/schemas/``), and
what each engine does with each of asupervisor's exit statuses is worked out from the
manifest by the engine's own matching rules (Kubernetes' podFailurePolicy, JobSet's
failurePolicy, the training operator's ExitCode policy), for the statuses read from the
project's own table (``Outcome``), and compared with the tables the docs show.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from asupervisor import Outcome
from asupervisor._run.group import Membership, Restarts, StatusMap, membership
from asupervisor._run.statuses import CANNOT_RUN, outcome_of
from asupervisor._run.supervisor import DEFAULT_GRACE_SECS
from asupervisor.cli import _parser
from tests import kubernetes_schemas as schemas

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "kubernetes"
PAGE = ROOT / "docs" / "kubernetes.md"
DISRUPTED = "DisruptionTarget"
# The statuses Kubeflow's training operator retries under restartPolicy: ExitCode (its
# IsRetryableExitCode: 130, 137, 138, 143); every other non-zero status fails the TFJob.
TFJOB_RETRIED = frozenset({130, 137, 138, 143})


def load(name: str) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((RECIPES / name).read_text())
    return manifest


def pod_spec(manifest: dict[str, Any]) -> Any:
    """The pod spec of a recipe's workers (itself: a change to it changes the manifest)."""
    spec = manifest["spec"]
    if manifest["kind"] == "JobSet":
        (replicated,) = spec["replicatedJobs"]
        spec = replicated["template"]["spec"]
    if manifest["kind"] == "TFJob":
        (replica,) = spec["tfReplicaSpecs"].values()
        return replica["template"]["spec"]
    return spec["template"]["spec"]


def job_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    """The (child) Job's spec of a Job or JobSet recipe."""
    if manifest["kind"] == "JobSet":
        (replicated,) = manifest["spec"]["replicatedJobs"]
        return dict(replicated["template"]["spec"])
    return dict(manifest["spec"])


def run_args(manifest: dict[str, Any]) -> Any:
    """The recipe's `asupervisor run` command line, parsed by asupervisor's own parser."""
    (container,) = pod_spec(manifest)["containers"]
    command = container["command"]
    assert command[:2] == ["asupervisor", "run"], command
    return _parser().parse_args(command[1:])


def cases() -> Iterator[tuple[str, int, Sequence[str]]]:
    """Each way a worker's container can end: every outcome's status, the shell's statuses
    for a command that cannot run, a SIGKILL (137), and a disrupted pod (preempted: on a Spot
    node killed after its grace, 137; or saved in time, 42)."""
    for outcome in Outcome:
        yield outcome.value, outcome.exit_status, ()
    for status in CANNOT_RUN:
        yield "cannot run", status, ()
    yield "killed", 137, ()
    yield "disrupted, killed", 137, (DISRUPTED,)
    yield "disrupted, saved", Outcome.PREEMPTED.exit_status, (DISRUPTED,)


CASE_IDS = [f"{cause}-{status}" for cause, status, _ in cases()]


# -- the engines' rules, as their sources state them ------------------------------------


def pod_failure_rule(
    policy: dict[str, Any], container: str, status: int, conditions: Sequence[str]
) -> tuple[int, str] | None:
    """Kubernetes' matchPodFailurePolicy: the first rule a failed pod matches (its index and
    action); onExitCodes never matches status 0; a condition pattern's status is "True"
    unless it says otherwise."""
    for index, rule in enumerate(policy["rules"]):
        codes = rule.get("onExitCodes")
        if codes is not None:
            if codes.get("containerName", container) != container or status == 0:
                continue
            inside = status in codes["values"]
            if inside == (codes["operator"] == "In"):
                return index, rule["action"]
        for pattern in rule.get("onPodConditions", ()):
            if pattern["type"] in conditions and pattern.get("status", "True") == "True":
                return index, rule["action"]
    return None


def job_failure(
    spec: dict[str, Any], container: str, status: int, conditions: Sequence[str]
) -> tuple[str, str, str] | None:
    """What the Job controller does with one failed pod: (what, the Job's failure reason,
    its message); None for a pod that succeeded. ``what`` is ignore, count or fail."""
    if status == 0 and not conditions:
        return None
    matched = pod_failure_rule(spec["podFailurePolicy"], container, status, conditions)
    if matched is not None and matched[1] == "Ignore":
        return "ignore", "", ""
    if matched is not None and matched[1] == "FailJob":
        index = matched[0]
        if conditions and "onPodConditions" in spec["podFailurePolicy"]["rules"][index]:
            why = f"Pod default/p has condition {conditions[0]}"
        else:
            why = f"Container {container} for pod default/p failed with exit code {status}"
        return "fail", "PodFailurePolicy", f"{why} matching FailJob rule at index {index}"
    if spec["backoffLimit"] == 0:
        return "fail", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    return "count", "", ""


def jobset_action(policy: dict[str, Any], reason: str, message: str) -> str:
    """JobSet's failure policy: the first rule whose reasons hold the Job's failure reason
    and one of whose patterns (RE2, unanchored, as Go's regexp.MatchString) matches its
    message; an empty list matches anything; no rule: RestartJobSet."""
    for rule in policy.get("rules", ()):
        reasons = rule.get("onJobFailureReasons", [])
        patterns = rule.get("onJobFailureMessagePatterns", [])
        if reasons and reason not in reasons:
            continue
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return str(rule["action"])
    return "RestartJobSet"


# What each engine does, in the words of the docs' tables.
JOBSET_WORDS = {
    "RestartJobSetAndIgnoreMaxRestarts": "restarts every worker, not counted",
    "RestartJobSet": "restarts every worker, counted against maxRestarts",
    "FailJobSet": "fails the JobSet",
}
JOB_WORDS = {
    "ignore": "a new pod, not counted",
    "count": "a new pod, counted against backoffLimit",
    "fail": "fails the Job",
}


def jobset_does(manifest: dict[str, Any], status: int, conditions: Sequence[str]) -> str:
    (container,) = pod_spec(manifest)["containers"]
    failure = job_failure(job_spec(manifest), container["name"], status, conditions)
    if failure is None:
        return "completes"
    what, reason, message = failure
    assert what == "fail", "a JobSet's child Job must fail at once (backoffLimit: 0)"
    return JOBSET_WORDS[jobset_action(manifest["spec"]["failurePolicy"], reason, message)]


def job_does(manifest: dict[str, Any], status: int, conditions: Sequence[str]) -> str:
    (container,) = pod_spec(manifest)["containers"]
    failure = job_failure(job_spec(manifest), container["name"], status, conditions)
    return "completes" if failure is None else JOB_WORDS[failure[0]]


def tfjob_shows(manifest: dict[str, Any], status: int) -> int:
    """The status a TFJob's operator sees for the run's own ``status``."""
    mapped: StatusMap = run_args(manifest).exit_status_map
    return mapped(status)


def tfjob_does(manifest: dict[str, Any], status: int, conditions: Sequence[str]) -> str:
    shown = tfjob_shows(manifest, status)
    if shown == 0:
        return "completes"
    return "a new pod for this worker" if shown in TFJOB_RETRIED else "fails the TFJob"


# -- the schemas -----------------------------------------------------------------------


CHECKS = {
    "job.yaml": schemas.resource_problems,
    "jobset.yaml": schemas.jobset_problems,
    "tfjob.yaml": schemas.tfjob_problems,
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_each_recipe_is_valid_against_the_published_schema_of_its_resource(name: str) -> None:
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(CHECKS)
    assert CHECKS[name](load(name)) == []


def test_the_schema_check_reads_the_schemas_stored_in_the_repository(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A copy of the stored files whose JobSet schema lacks a field the recipe uses: the
    # check follows the copy, and no package's schemas are consulted.
    for stored in schemas.SCHEMAS.glob("*.json"):
        (tmp_path / stored.name).write_text(stored.read_text())
    jobset = json.loads((tmp_path / "jobset-v1alpha2.json").read_text())
    del jobset["$defs"]["JobsetV1alpha2FailurePolicy"]["properties"]["maxRestarts"]
    (tmp_path / "jobset-v1alpha2.json").write_text(json.dumps(jobset))
    monkeypatch.setattr(schemas, "SCHEMAS", tmp_path)
    problems = schemas.jobset_problems(load("jobset.yaml"))
    assert f"spec/failurePolicy: {UNEXPECTED.format('maxRestarts')} (Kubernetes 1.31.0)" in problems
    assert not {"kubernetes_validate", "kubeflow", "kubeflow_trainer_api"} & set(sys.modules)


def _container(manifest: dict[str, Any]) -> Any:
    return pod_spec(manifest)["containers"][0]


# A misspelt field at each level a recipe relies on, a value of the wrong type, a missing
# required field: each must fail the check, saying where and what.
UNEXPECTED = "Additional properties are not allowed ('{}' was unexpected)"
MISTAKES: dict[str, list[tuple[str, Any]]] = {
    "job.yaml": [
        ("spec: " + UNEXPECTED.format("backofLimit"), lambda m: m["spec"].update(backofLimit=3)),
        (
            "spec/podFailurePolicy/rules/0: " + UNEXPECTED.format("onExitCode"),
            lambda m: m["spec"]["podFailurePolicy"]["rules"][0].update(onExitCode={}),
        ),
        ("containers/0: " + UNEXPECTED.format("comand"), lambda m: _container(m).update(comand=[])),
        ("spec/backoffLimit: '3' is not of type", lambda m: m["spec"].update(backoffLimit="3")),
    ],
    "jobset.yaml": [
        (
            "spec/failurePolicy: " + UNEXPECTED.format("maxRestart"),
            lambda m: m["spec"]["failurePolicy"].update(maxRestart=3),
        ),
        (
            "spec/failurePolicy/rules/0: " + UNEXPECTED.format("onJobFailureMessagePattern"),
            lambda m: m["spec"]["failurePolicy"]["rules"][0].update(onJobFailureMessagePattern=[]),
        ),
        (
            "spec/network: " + UNEXPECTED.format("enableDnsHostnames"),
            lambda m: m["spec"]["network"].update(enableDnsHostnames=True),
        ),
        (
            "spec/replicatedJobs/0/template/spec: " + UNEXPECTED.format("podFailurePolicies"),
            lambda m: m["spec"]["replicatedJobs"][0]["template"]["spec"].update(
                podFailurePolicies={}
            ),
        ),
        ("containers/0: " + UNEXPECTED.format("envFrm"), lambda m: _container(m).update(envFrm=[])),
        (
            "spec/failurePolicy/maxRestarts: '3' is not of type",
            lambda m: m["spec"]["failurePolicy"].update(maxRestarts="3"),
        ),
        (
            "spec/failurePolicy/rules/1: 'action' is a required property",
            lambda m: m["spec"]["failurePolicy"]["rules"][1].pop("action"),
        ),
        (
            "spec/failurePolicy/rules/0/action: 'RestartJobset' is not one of",
            lambda m: m["spec"]["failurePolicy"]["rules"][0].update(action="RestartJobset"),
        ),
        (
            "spec/failurePolicy/restartStrategy: 'Restart' is not one of",
            lambda m: m["spec"]["failurePolicy"].update(restartStrategy="Restart"),
        ),
        (
            "spec/failurePolicy/rules/0/name: 'preempted-pod' does not match",
            lambda m: m["spec"]["failurePolicy"]["rules"][0].update(name="preempted-pod"),
        ),
    ],
    "tfjob.yaml": [
        ("spec: " + UNEXPECTED.format("runpolicy"), lambda m: m["spec"].update(runpolicy={})),
        (
            "spec/tfReplicaSpecs/Worker: " + UNEXPECTED.format("restartpolicy"),
            lambda m: m["spec"]["tfReplicaSpecs"]["Worker"].update(restartpolicy="ExitCode"),
        ),
        ("containers/0: " + UNEXPECTED.format("port"), lambda m: _container(m).update(port=[])),
        (
            "spec/tfReplicaSpecs/Worker/replicas: '2' is not of type 'integer'",
            lambda m: m["spec"]["tfReplicaSpecs"]["Worker"].update(replicas="2"),
        ),
        (
            "spec: 'tfReplicaSpecs' is a required property",
            lambda m: m["spec"].pop("tfReplicaSpecs"),
        ),
    ],
}


@pytest.mark.parametrize(
    ("name", "said", "mistake"),
    [(name, said, mistake) for name, found in MISTAKES.items() for said, mistake in found],
    ids=[f"{name}:{said.split(':')[0]}" for name, found in MISTAKES.items() for said, _ in found],
)
def test_a_misspelt_field_a_wrong_type_or_a_missing_field_fails_the_schema_check(
    name: str, said: str, mistake: Any
) -> None:
    manifest = copy.deepcopy(load(name))
    mistake(manifest)
    problems = CHECKS[name](manifest)
    assert any(said in problem for problem in problems), problems


# Values the APIs give as plain strings (their schemas have no enum for them): what the
# engines' sources accept. Kubernetes' batch/v1 and core/v1 types; the training operator's
# kubeflow.org/v1 ReplicaSpec and TFJob replica types. (JobSet's schema has its enums and
# a rule name's pattern: the schema check covers them.)
POD_FAILURE_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}
EXIT_CODE_OPERATORS = {"In", "NotIn"}
TFJOB_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
TFJOB_REPLICA_TYPES = {"Chief", "Master", "Worker", "PS", "Evaluator"}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_values_no_schema_checks_are_ones_the_engines_know(name: str) -> None:
    manifest = load(name)
    if manifest["kind"] == "TFJob":
        for replica_type, replica in manifest["spec"]["tfReplicaSpecs"].items():
            assert replica_type in TFJOB_REPLICA_TYPES
            assert replica["restartPolicy"] in TFJOB_RESTART_POLICIES
        return
    # A podFailurePolicy needs restartPolicy: Never (the API server refuses it otherwise).
    assert pod_spec(manifest)["restartPolicy"] == "Never"
    for rule in job_spec(manifest)["podFailurePolicy"]["rules"]:
        assert rule["action"] in POD_FAILURE_ACTIONS
        assert rule.get("onExitCodes", {}).get("operator", "In") in EXIT_CODE_OPERATORS


# -- what each engine does with each status ---------------------------------------------


def expected_jobset(outcome: Outcome, conditions: Sequence[str]) -> str:
    """The JobSet recipe's promise: a preempted or disrupted pod restarts every worker
    without counting, a permanent failure fails the JobSet, done completes, and every
    other status (whatever outcome the project adds) restarts every worker, counted."""
    if conditions or outcome is Outcome.PREEMPTED:
        return JOBSET_WORDS["RestartJobSetAndIgnoreMaxRestarts"]
    if outcome is Outcome.DONE:
        return "completes"
    if outcome is Outcome.FAILED_PERMANENTLY:
        return JOBSET_WORDS["FailJobSet"]
    return JOBSET_WORDS["RestartJobSet"]


@pytest.mark.parametrize(("cause", "status", "conditions"), list(cases()), ids=CASE_IDS)
def test_a_jobset_restarts_every_worker_on_all_but_done_and_permanent_counting_all_but_preemption(
    cause: str, status: int, conditions: Sequence[str]
) -> None:
    manifest = load("jobset.yaml")
    assert jobset_does(manifest, status, conditions) == expected_jobset(
        outcome_of(status), conditions
    ), cause


def expected_job(outcome: Outcome, conditions: Sequence[str]) -> str:
    if conditions or outcome is Outcome.PREEMPTED:
        return JOB_WORDS["ignore"]
    if outcome is Outcome.DONE:
        return "completes"
    if outcome is Outcome.FAILED_PERMANENTLY:
        return JOB_WORDS["fail"]
    return JOB_WORDS["count"]


@pytest.mark.parametrize(("cause", "status", "conditions"), list(cases()), ids=CASE_IDS)
def test_a_job_replaces_the_pod_counting_all_but_preemption_and_fails_on_a_permanent_status(
    cause: str, status: int, conditions: Sequence[str]
) -> None:
    manifest = load("job.yaml")
    assert job_does(manifest, status, conditions) == expected_job(outcome_of(status), conditions), (
        cause
    )


def test_a_tfjob_retries_a_preempted_a_stuck_and_a_killed_worker_and_no_permanent_one() -> None:
    manifest = load("tfjob.yaml")
    # A store out of reach is most often transient: retried, not the TFJob's end.
    for outcome in (Outcome.PREEMPTED, Outcome.STUCK, Outcome.LOST_PEER, Outcome.UNREACHABLE):
        assert tfjob_shows(manifest, outcome.exit_status) in TFJOB_RETRIED, outcome
    assert tfjob_shows(manifest, 137) in TFJOB_RETRIED
    assert tfjob_shows(manifest, Outcome.DONE.exit_status) == 0
    for status in (Outcome.FAILED_PERMANENTLY.exit_status, *CANNOT_RUN):
        assert tfjob_shows(manifest, status) not in TFJOB_RETRIED | {0}
    # The operator reads the exit status of the container named "tensorflow" only.
    assert [c["name"] for c in pod_spec(manifest)["containers"]] == ["tensorflow"]
    (replica,) = manifest["spec"]["tfReplicaSpecs"].values()
    assert replica["restartPolicy"] == "ExitCode"


# -- the workers' command lines and TF_CONFIG -------------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_grace_periods_nest_kubernetes_then_asupervisor_run(name: str) -> None:
    manifest = load(name)
    args = run_args(manifest)
    # At least the default, which is more than the session's default stop_grace_secs plus
    # an exit (a smaller one needs a smaller stop_grace_secs in the script).
    assert args.grace >= DEFAULT_GRACE_SECS
    # Kubernetes kills the container terminationGracePeriodSeconds after its SIGTERM: the
    # supervisor must have stopped its child (final checkpoint) and exited before.
    assert pod_spec(manifest)["terminationGracePeriodSeconds"] > args.grace


@pytest.mark.parametrize("name", ["jobset.yaml", "tfjob.yaml"])
def test_a_worker_of_a_job_across_pods_leaves_every_restart_to_the_engine(name: str) -> None:
    args = run_args(load(name))
    assert args.restarts is Restarts.ENGINE
    assert args.workers == 1 and not args.slurm


def pod_environment(container: dict[str, Any], index: int) -> dict[str, str]:
    """A container's environment as the kubelet makes it in pod ``index`` of an Indexed
    Job: a fieldRef to the completion-index annotation is the index, and a value's
    $(NAME) is expanded from the variables defined before it (unknown ones left as they
    are, as Kubernetes does)."""
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        if "valueFrom" in variable:
            path = variable["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            env[variable["name"]] = str(index)
        else:
            assert "$$(" not in variable["value"]
            env[variable["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                variable["value"],
            )
    return env


def test_each_jobset_pod_gets_the_tf_config_its_worker_index_needs() -> None:
    """What MultiWorkerMirroredStrategy expects: one cluster, the same in every worker, of
    N workers in index order, each at an address that reaches that pod (its stable DNS
    name: JobSet's <jobset>-<job>-<job index> Job, Indexed Job's -<pod index> hostname,
    JobSet's subdomain) on the port the container opens; and the pod's own index."""
    manifest = load("jobset.yaml")
    (replicated,) = manifest["spec"]["replicatedJobs"]
    spec = replicated["template"]["spec"]
    network = manifest["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    assert replicated["replicas"] == 1 and spec["completionMode"] == "Indexed"
    workers = spec["parallelism"]
    assert spec["completions"] == workers >= 2
    (container,) = spec["template"]["spec"]["containers"]
    (port,) = [p["containerPort"] for p in container["ports"]]
    subdomain = network.get("subdomain", manifest["metadata"]["name"])
    job = f"{manifest['metadata']['name']}-{replicated['name']}-0"
    names = [f"{job}-{index}.{subdomain}:{port}" for index in range(workers)]
    for index in range(workers):
        env = pod_environment(container, index)
        config = json.loads(env["TF_CONFIG"])
        assert config == {"cluster": {"worker": names}, "task": {"type": "worker", "index": index}}
        # asupervisor run would tell from it alone that it is one worker of a larger job.
        assert membership(Restarts.AUTO, env, 1) == Membership(
            Restarts.ENGINE, f"one task of {workers} in its TF_CONFIG"
        )


# -- the docs --------------------------------------------------------------------------

DOES = {"JobSet": jobset_does, "Job": job_does, "TFJob": tfjob_does}
RECIPE_OF = {"JobSet": "jobset.yaml", "Job": "job.yaml", "TFJob": "tfjob.yaml"}


def docs_tables() -> dict[str, list[list[str]]]:
    """The page's tables "cause | exit status | what the ENGINE does", by ENGINE."""
    tables: dict[str, list[list[str]]] = {}
    engine = None
    for line in PAGE.read_text().splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        header = re.fullmatch(r"what (?:the |a )?(\w+) does", cells[-1]) if cells else None
        if header is not None:
            engine = header.group(1)
            tables[engine] = []
        elif cells and engine is not None and not set(cells[0]) <= set("-: "):
            tables[engine].append(cells)
        elif not cells:
            engine = None
    return tables


def statuses_in(cell: str) -> list[int]:
    """The run's own statuses a table cell names (before an arrow: what a map shows)."""
    return [int(s) for s in re.findall(r"\b\d+\b", cell.split("→")[0])]


def test_the_docs_tables_say_what_each_engine_does_with_each_status() -> None:
    """Each engine's table on the page: every row is what the engine does with the
    recipe, and every outcome's status has a row ("any other" covers those not named)."""
    tables = docs_tables()
    assert sorted(tables) == sorted(DOES)
    for engine, rows in tables.items():
        manifest = load(RECIPE_OF[engine])
        named = {s for cause, cell, _ in rows if DISRUPTED not in cause for s in statuses_in(cell)}
        others = [o.exit_status for o in Outcome if o.exit_status not in named]
        if others:
            assert any(cell.startswith("any other") for _, cell, _ in rows), (
                f"{engine}: no row for {[outcome_of(s).value for s in others]}"
            )
        for cause, cell, does in rows:
            conditions = (DISRUPTED,) if DISRUPTED in cause else ()
            for status in others if cell.startswith("any other") else statuses_in(cell):
                assert does.startswith(DOES[engine](manifest, status, conditions)), (
                    f"{engine}: {cause} ({status}): the page says {does!r}"
                )
