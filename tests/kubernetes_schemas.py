"""Kubernetes manifests checked against the published schemas of their resources, strictly:
a field a schema does not know is an error, as it is for a server that rejects unknown
fields (``kubectl apply --validate=strict``, the default).

Every schema comes from a package the test extra installs; nothing is fetched:

- Kubernetes' own resources (``Job``, and every Kubernetes type embedded in another
  resource: a JobSet's Job template, a TFJob's pod templates): ``kubernetes-validate``'s
  JSON schemas, its ``-strict`` variants (``additionalProperties: false`` everywhere).
- ``JobSet`` (``jobset.x-k8s.io/v1alpha2``): the pydantic models that
  ``kubeflow-trainer-api`` generates from JobSet's OpenAPI. A model ignores unknown
  fields, so the check is the models' JSON schema with every object closed. The oneOf
  wrappers it generates for a quantity or an int-or-string have no usable schema; they
  are left open here and checked by Kubernetes' own schema (the Job template).
- ``TFJob`` (``kubeflow.org/v1``): the models that ``kubeflow-training`` generates from the
  training operator's OpenAPI (``openapi_types``/``attribute_map``, each model's setters
  refusing a missing required field); the Kubernetes types they embed are checked by
  Kubernetes' own schema.

What none of them checks: an enum the OpenAPI gives as a plain string (a JobSet rule's
``action``, ``restartStrategy``, a TFJob replica's ``restartPolicy`` and replica type), the
admission webhooks' own rules (a rule's name pattern, DNS-label lengths), and what a
controller does with the fields. The recipe tests check those they rely on.
"""

from __future__ import annotations

import importlib
import json
import re
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import referencing
import referencing.jsonschema

# The oldest Kubernetes the recipes are for (podFailurePolicy and its DisruptionTarget
# condition are GA from 1.31), and the newest the package has.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """The errors under an anyOf/oneOf error: the optional fields' schemas are "this, or
    null", and the value's own errors are in the first branch, not in "not null"."""
    if not error.context:
        return [error]
    inner = [
        e for e in error.context if not (e.validator == "type" and e.validator_value == "null")
    ]
    return [leaf for e in inner for leaf in _leaves(e)] or [error]


def _messages(validator: jsonschema.protocols.Validator, value: Any) -> list[str]:
    """Every error, each with its path."""
    found = []
    for error in validator.iter_errors(value):
        for leaf in _leaves(error):
            where = "/".join(str(p) for p in leaf.absolute_path) or "(top)"
            found.append(f"{where}: {leaf.message[:300]}")
    return sorted(set(found))


@cache
def _kubernetes_registry(version: str) -> referencing.Registry:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    text = (folder / f"v{version}-local-strict" / "_definitions.json").read_text()
    definitions = referencing.Resource.from_contents(json.loads(text))
    return referencing.Registry().with_resource(DEFINITIONS_ID, definitions)


def kubernetes_definitions(version: str) -> dict[str, Any]:
    """Kubernetes' strict schemas of ``version``, by definition name."""
    contents = _kubernetes_registry(version).contents(DEFINITIONS_ID)
    defs: dict[str, Any] = contents["$defs"]
    return defs


def kubernetes_problems(value: Any, definition: str, version: str) -> list[str]:
    """What is wrong with ``value`` as Kubernetes' ``definition`` (``io.k8s.api.batch.v1.Job``,
    ``io.k8s.api.core.v1.PodTemplateSpec``, ...) in Kubernetes ``version``, strictly."""
    if definition not in kubernetes_definitions(version):
        return [f"Kubernetes {version} has no {definition}"]
    schema = {"$ref": f"{DEFINITIONS_ID}#/$defs/{definition}"}
    validator = jsonschema.Draft202012Validator(schema, registry=_kubernetes_registry(version))
    return _messages(validator, value)


# The built-in kinds the recipes use: (apiVersion, Kubernetes' definition).
KINDS = {"Job": ("batch/v1", "io.k8s.api.batch.v1.Job")}


def resource_problems(resource: dict[str, Any]) -> list[str]:
    """What is wrong with a Kubernetes resource of a built-in kind, strictly, for every
    Kubernetes version checked."""
    kind = resource.get("kind")
    if kind not in KINDS or resource.get("apiVersion") != KINDS[kind][0]:
        return [f"(top): not one of {KINDS}"]
    return [
        f"{problem} (Kubernetes {version})"
        for version in KUBERNETES_VERSIONS
        for problem in kubernetes_problems(resource, KINDS[kind][1], version)
    ]


# -- JobSet ---------------------------------------------------------------------------


def _closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others, and the
    generated oneOf wrappers (a quantity, an int-or-string: their "properties" are the
    wrapper's own, not the value's) left open."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if "actual_instance" in schema.get("properties", {}):
        return {"description": "checked by Kubernetes' own schema"}
    closed = {key: _closed(item) for key, item in schema.items()}
    if "properties" in closed:
        closed.setdefault("additionalProperties", False)
    return closed


@cache
def jobset_schema() -> dict[str, Any]:
    """The JSON schema of JobSet ``v1alpha2`` from ``kubeflow-trainer-api``'s models, closed."""
    from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet

    schema: dict[str, Any] = _closed(JobsetV1alpha2JobSet.model_json_schema(by_alias=True))
    return schema


def jobset_problems(resource: dict[str, Any]) -> list[str]:
    """What is wrong with a JobSet, strictly: the JobSet's own schema, then each replicated
    job's Job template against Kubernetes' strict ``JobTemplateSpec`` of every version."""
    problems = []
    if resource.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or resource.get("kind") != "JobSet":
        problems.append("(top): not a jobset.x-k8s.io/v1alpha2 JobSet")
    problems += _messages(jsonschema.Draft202012Validator(jobset_schema()), resource)
    for i, replicated in enumerate(resource.get("spec", {}).get("replicatedJobs", [])):
        for version in KUBERNETES_VERSIONS:
            template = replicated.get("template", {})
            for problem in kubernetes_problems(
                template, "io.k8s.api.batch.v1.JobTemplateSpec", version
            ):
                problems.append(
                    f"spec/replicatedJobs/{i}/template/{problem} (Kubernetes {version})"
                )
    return problems


def jobset_rule_values() -> tuple[frozenset[str], str]:
    """What JobSet's models say in words, not in their schema: a failure policy rule's
    valid actions ("Valid values are A, B, ...") and the pattern its name must match."""
    from kubeflow_trainer_api.models.jobset_v1alpha2_failure_policy_rule import (
        JobsetV1alpha2FailurePolicyRule as Rule,
    )

    fields = Rule.model_fields
    actions = re.search(r"Valid values are ([\w, ]+)\.", fields["action"].description or "")
    pattern = re.search(r'regular expression "([^"]+)"', fields["name"].description or "")
    assert actions is not None and pattern is not None, "JobSet's model describes them no more"
    return frozenset(a.strip() for a in actions.group(1).split(",")), pattern.group(1)


# -- TFJob ----------------------------------------------------------------------------

_LIST = re.compile(r"^list\[(.+)\]$")
_DICT = re.compile(r"^dict\(str, (.+)\)$")
_PRIMITIVE: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),
    "datetime": (str,),
    "date": (str,),
}


def _kubernetes_definition_of(client_type: str, version: str) -> str | None:
    """Kubernetes' definition for a client model's name (``V1PodTemplateSpec``)."""
    match = re.match(r"^V(\d+(?:(?:alpha|beta)\d+)?)(\w+)$", client_type)
    if match is None:
        return None
    suffix = f".v{match.group(1)}.{match.group(2)}"
    found = [name for name in kubernetes_definitions(version) if name.endswith(suffix)]
    return found[0] if len(found) == 1 else None


def openapi_problems(value: Any, type_name: str, where: str, version: str) -> list[str]:
    """What is wrong with ``value`` as the training operator's model ``type_name``: an
    unknown field, a value of the wrong type, a missing required field; the Kubernetes
    types it embeds against Kubernetes' strict schema of ``version``."""
    if value is None:
        return []
    if (listed := _LIST.match(type_name)) is not None:
        if not isinstance(value, list):
            return [f"{where}: {value!r} is not a list"]
        return [
            p
            for i, item in enumerate(value)
            for p in openapi_problems(item, listed.group(1), f"{where}/{i}", version)
        ]
    if (mapped := _DICT.match(type_name)) is not None:
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not a mapping"]
        return [
            p
            for key, item in value.items()
            for p in openapi_problems(item, mapped.group(1), f"{where}/{key}", version)
        ]
    if type_name in _PRIMITIVE:
        wrong = not isinstance(value, _PRIMITIVE[type_name]) or (
            type_name == "int" and isinstance(value, bool)
        )
        return [f"{where}: {value!r} is not {type_name}"] if wrong else []
    if type_name.startswith("KubeflowOrg"):
        return _model_problems(value, type_name, where, version)
    definition = _kubernetes_definition_of(type_name, version)
    if definition is None:
        return [f"{where}: no schema for {type_name}"]
    return [f"{where}/{p}" for p in kubernetes_problems(value, definition, version)]


def _model_problems(value: Any, type_name: str, where: str, version: str) -> list[str]:
    models = importlib.import_module("kubeflow.training.models")
    model = getattr(models, type_name)
    if not isinstance(value, dict):
        return [f"{where}: {value!r} is not a {type_name}"]
    by_key = {key: attribute for attribute, key in model.attribute_map.items()}
    problems = [
        f"{where}/{key}: {type_name} has no such field" for key in value if key not in by_key
    ]
    known = {by_key[key]: item for key, item in value.items() if key in by_key}
    try:  # the model's setters refuse a required field that is missing
        model(**known)
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
    for attribute, item in known.items():
        key = model.attribute_map[attribute]
        problems += openapi_problems(
            item, model.openapi_types[attribute], f"{where}/{key}", version
        )
    return problems


def tfjob_problems(resource: dict[str, Any]) -> list[str]:
    """What is wrong with a TFJob, strictly, for every Kubernetes version checked."""
    problems = []
    if resource.get("apiVersion") != "kubeflow.org/v1" or resource.get("kind") != "TFJob":
        problems.append("(top): not a kubeflow.org/v1 TFJob")
    for version in KUBERNETES_VERSIONS:
        for problem in openapi_problems(resource, "KubeflowOrgV1TFJob", "", version):
            problems.append(f"{problem.lstrip('/')} (Kubernetes {version})")
    return sorted(set(problems))
