"""Kubernetes manifests checked against the schemas of their resources, strictly: a field a
schema does not know is an error, as it is for a server that rejects unknown fields
(``kubectl apply --validate=strict``, the default).

The schemas are files of the repository, ``tests/schemas/``; the check reads nothing else
(``tests/schemas/make.py`` says where each comes from and writes them again):

- ``kubernetes-<version>.json``: Kubernetes' own strict schemas (``additionalProperties:
  false`` everywhere) of each version checked, for ``Job`` and every Kubernetes type
  embedded in another resource (a JobSet's Job template, a TFJob's pod templates).
- ``jobset-v1alpha2.json``: ``JobSet`` (``jobset.x-k8s.io/v1alpha2``), every object closed,
  with the enums of JobSet's CRD (a failure policy rule's ``action``, ``restartStrategy``,
  ...) and a rule name's pattern.
- ``tfjob-v1.json``: ``TFJob`` (``kubeflow.org/v1``), every object closed.

The last two refer to ``kubernetes.json`` for the Kubernetes types they embed: each version's
file is bound to that name in turn.

What none of them checks: an enum the APIs give as a plain string (a TFJob replica's
``restartPolicy`` and replica type, a pod failure rule's ``action``), the admission
webhooks' own rules (DNS-label lengths), and what a controller does with the fields. The
recipe tests check those they rely on.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import referencing.jsonschema

SCHEMAS = Path(__file__).resolve().parent / "schemas"
# The oldest Kubernetes the recipes are for (podFailurePolicy and its DisruptionTarget
# condition are GA from 1.31), and the newest the schemas were made from.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
# The name the JobSet and TFJob schemas give Kubernetes' definitions.
KUBERNETES = "kubernetes.json"


def stored(name: str) -> dict[str, Any]:
    """A schema file of tests/schemas."""
    return _read(SCHEMAS / name)


@cache
def _read(path: Path) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


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


def _registry(version: str) -> referencing.Registry:
    """Kubernetes' definitions of ``version``, as ``kubernetes.json``."""
    return _registry_of(SCHEMAS / f"kubernetes-{version}.json")


@cache
def _registry_of(path: Path) -> referencing.Registry:
    definitions = referencing.jsonschema.DRAFT202012.create_resource(_read(path))
    registry: referencing.Registry = referencing.Registry().with_resource(KUBERNETES, definitions)
    return registry


def kubernetes_definitions(version: str) -> dict[str, Any]:
    """Kubernetes' strict schemas of ``version`` that the recipes' resources use, by name."""
    defs: dict[str, Any] = stored(f"kubernetes-{version}.json")["$defs"]
    return defs


def _problems(value: Any, schema: dict[str, Any], version: str) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema, registry=_registry(version))
    return _messages(validator, value)


def kubernetes_problems(value: Any, definition: str, version: str) -> list[str]:
    """What is wrong with ``value`` as Kubernetes' ``definition`` (``io.k8s.api.batch.v1.Job``,
    ``io.k8s.api.batch.v1.JobTemplateSpec``, ...) in Kubernetes ``version``, strictly."""
    if definition not in kubernetes_definitions(version):
        return [f"{definition}: not among the stored Kubernetes {version} schemas"]
    return _problems(value, {"$ref": f"{KUBERNETES}#/$defs/{definition}"}, version)


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


def _custom_problems(resource: dict[str, Any], api: str, kind: str, name: str) -> list[str]:
    """What is wrong with a resource of a custom kind, against its stored schema ``name``
    with the Kubernetes types it embeds of every version checked."""
    problems = []
    if resource.get("apiVersion") != api or resource.get("kind") != kind:
        problems.append(f"(top): not a {api} {kind}")
    for version in KUBERNETES_VERSIONS:
        for problem in _problems(resource, stored(name), version):
            problems.append(f"{problem} (Kubernetes {version})")
    return problems


def jobset_problems(resource: dict[str, Any]) -> list[str]:
    """What is wrong with a JobSet, strictly, for every Kubernetes version checked."""
    return _custom_problems(resource, "jobset.x-k8s.io/v1alpha2", "JobSet", "jobset-v1alpha2.json")


def tfjob_problems(resource: dict[str, Any]) -> list[str]:
    """What is wrong with a TFJob, strictly, for every Kubernetes version checked."""
    return _custom_problems(resource, "kubeflow.org/v1", "TFJob", "tfjob-v1.json")
