"""Writes the schemas that tests/kubernetes_schemas.py checks the Kubernetes recipes against
(the files beside this one); the test suite only reads them.

They are made once from these packages, at these versions, installed beside this script's
Python (``python -m pip install -r tests/schemas/sources.txt``, then
``python tests/schemas/make.py``):

- ``kubernetes-<version>.json``: Kubernetes' strict JSON schemas (``additionalProperties:
  false`` on every object) from ``kubernetes-validate``, for each version the recipes are
  for, holding only the definitions the recipes' resources use, without descriptions.
- ``jobset-v1alpha2.json``: JobSet's ``jobset.x-k8s.io/v1alpha2`` schema, from the models
  that ``kubeflow-trainer-api`` generates from JobSet's OpenAPI, every object closed; the
  values a string field's description lists (a failure policy rule's ``action``, the pattern
  of its ``name``) made its ``enum`` and ``pattern``, and the other enums of JobSet's CRD
  (``JOBSET_ENUMS``), as in JobSet's CRD.
- ``tfjob-v1.json``: the training operator's ``kubeflow.org/v1`` TFJob schema, from the
  models that ``kubeflow-training`` generates from its OpenAPI (their ``openapi_types`` and
  ``attribute_map``; a field is required where its setter refuses ``None`` and the CRD
  requires it too), every object closed.

In both, each Kubernetes type they embed is a ``$ref`` into ``kubernetes.json``, which the
check binds to each Kubernetes version in turn.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from importlib import metadata, resources
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KUBERNETES = "kubernetes.json"
# Kubernetes' own types that the recipes' resources use directly.
ROOTS = ("io.k8s.api.batch.v1.Job", "io.k8s.api.batch.v1.JobTemplateSpec")


def sources() -> dict[str, str]:
    """The pinned packages, ``name==version`` a line in sources.txt."""
    lines = (HERE / "sources.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {name: version for name, version in pins}


def kubernetes_versions() -> tuple[str, ...]:
    """The versions the check uses (``KUBERNETES_VERSIONS`` in tests/kubernetes_schemas.py)."""
    text = (HERE.parent / "kubernetes_schemas.py").read_text()
    found = re.search(r"^KUBERNETES_VERSIONS = \(([^)]*)\)", text, re.MULTILINE)
    assert found is not None, "tests/kubernetes_schemas.py has no KUBERNETES_VERSIONS"
    return tuple(v.strip().strip('"') for v in found.group(1).split(",") if v.strip())


def all_kubernetes_definitions(version: str) -> dict[str, Any]:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    text = (folder / f"v{version}-local-strict" / "_definitions.json").read_text()
    defs: dict[str, Any] = json.loads(text)["$defs"]
    return defs


def refs(schema: Any) -> set[str]:
    """The local definitions ``schema`` refers to."""
    if isinstance(schema, list):
        return {name for item in schema for name in refs(item)}
    if not isinstance(schema, dict):
        return set()
    found = {name for item in schema.values() for name in refs(item)}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        found.add(ref.removeprefix("#/$defs/"))
    return found


def kubernetes_refs(schema: Any) -> set[str]:
    """The Kubernetes definitions ``schema`` refers to in ``kubernetes.json``."""
    text = json.dumps(schema)
    return set(re.findall(rf'"{re.escape(KUBERNETES)}#/\$defs/([^"]+)"', text))


def without_descriptions(schema: Any, in_properties: bool = False) -> Any:
    """``schema`` without its descriptions (a property named "description" stays)."""
    if isinstance(schema, list):
        return [without_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: without_descriptions(item, in_properties=key == "properties" and not in_properties)
        for key, item in schema.items()
        if in_properties or key != "description"
    }


def kubernetes_schema(version: str, roots: set[str]) -> dict[str, Any]:
    """The definitions ``roots`` need, as one document."""
    every = all_kubernetes_definitions(version)
    needed: set[str] = set()
    todo = set(roots)
    while todo:
        name = todo.pop()
        needed.add(name)
        todo |= refs(every[name]) - needed
    return {"$defs": {name: without_descriptions(every[name]) for name in sorted(needed)}}


def kubernetes_name(flat: str, every: dict[str, Any]) -> str:
    """Kubernetes' definition for a generated model's name (``IoK8sApiBatchV1JobSpec``)."""
    found = [name for name in every if name.replace(".", "").lower() == flat.lower()]
    assert len(found) == 1, (flat, found)
    return found[0]


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    done = {key: closed(item) for key, item in schema.items()}
    if "properties" in done:
        done.setdefault("additionalProperties", False)
    return done


def worded(schema: Any) -> Any:
    """``schema`` with the values a string field's description gives in words ("Valid values
    are A, B.", "must match the regular expression \"...\"") as its ``enum`` or ``pattern``,
    as JobSet's CRD has them (the OpenAPI the models come from has them in words only)."""
    if isinstance(schema, list):
        return [worded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    done = {key: worded(item) for key, item in schema.items()}
    if done.get("type") == "string":
        text = done.get("description", "")
        if (values := re.search(r"Valid values are ([\w, ]+)\.", text)) is not None:
            done["enum"] = [value.strip() for value in values.group(1).split(",")]
        if (pattern := re.search(r'must match the regular expression "([^"]+)"', text)) is not None:
            done["pattern"] = pattern.group(1)
    return done


# The enums JobSet's CRD (v0.12.0, +kubebuilder:validation:Enum on its Go types) gives
# string fields whose OpenAPI, which the models come from, has no enum: (model, field).
JOBSET_ENUMS = {
    ("JobsetV1alpha2FailurePolicy", "restartStrategy"): [
        "Recreate",
        "BlockingRecreate",
        "InPlaceRestart",
    ],
    ("JobsetV1alpha2SuccessPolicy", "operator"): ["All", "Any"],
    ("JobsetV1alpha2StartupPolicy", "startupPolicyOrder"): ["AnyOrder", "InOrder"],
    ("JobsetV1alpha2VolumeRetentionPolicy", "whenDeleted"): ["Delete", "Retain"],
    ("JobsetV1alpha2DependsOn", "status"): ["Ready", "Complete"],
}


def with_enums(schema: dict[str, Any]) -> dict[str, Any]:
    for (model, field), values in JOBSET_ENUMS.items():
        found = schema["$defs"][model]["properties"][field]
        (string,) = [s for s in found.get("anyOf", [found]) if s.get("type") == "string"]
        string["enum"] = values
    return schema


def jobset_schema(every: dict[str, Any]) -> dict[str, Any]:
    from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet

    schema = JobsetV1alpha2JobSet.model_json_schema(by_alias=True)
    text = json.dumps(schema)
    for name in schema["$defs"]:
        if name.startswith("IoK8s"):
            target = f"{KUBERNETES}#/$defs/{kubernetes_name(name, every)}"
            text = text.replace(f'"#/$defs/{name}"', json.dumps(target))
    schema = json.loads(text)
    schema["$defs"] = {k: v for k, v in schema["$defs"].items() if not k.startswith("IoK8s")}
    assert refs(schema) <= set(schema["$defs"]), refs(schema) - set(schema["$defs"])
    schema = with_enums(worded(closed(schema)))
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


_PRIMITIVE = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "bool": {"type": "boolean"},
    "float": {"type": "number"},
    "object": {},
    "datetime": {"type": "string"},
    "date": {"type": "string"},
}


# Fields whose model refuses None but which the training operator's CRD (v1.9.0) does not
# require (the operator defaults them): (model, field).
DEFAULTED = {("KubeflowOrgV1TFJobSpec", "runPolicy")}


def tfjob_schema(every: dict[str, Any]) -> dict[str, Any]:
    models = importlib.import_module("kubeflow.training.models")
    defs: dict[str, Any] = {}

    def of(type_name: str) -> dict[str, Any]:
        if (listed := re.match(r"^list\[(.+)\]$", type_name)) is not None:
            return {"type": "array", "items": of(listed.group(1))}
        if (mapped := re.match(r"^dict\(str, (.+)\)$", type_name)) is not None:
            return {"type": "object", "additionalProperties": of(mapped.group(1))}
        if type_name in _PRIMITIVE:
            return dict(_PRIMITIVE[type_name])
        if type_name.startswith("KubeflowOrg"):
            if type_name not in defs:
                defs[type_name] = {}  # a placeholder while its fields are made
                defs[type_name] = model(getattr(models, type_name))
            return {"$ref": f"#/$defs/{type_name}"}
        named = re.match(r"^V(\d+(?:(?:alpha|beta)\d+)?)(\w+)$", type_name)
        suffix = f".v{named.group(1)}.{named.group(2)}" if named else f".{type_name}"
        (found,) = [name for name in every if name.endswith(suffix)]
        return {"$ref": f"{KUBERNETES}#/$defs/{found}"}

    def model(cls: Any) -> dict[str, Any]:
        properties = {}
        required = []
        for attribute, type_name in cls.openapi_types.items():
            key = cls.attribute_map[attribute]
            properties[key] = of(type_name)
            setter = inspect.getsource(getattr(cls, attribute).fset)
            if "must not be `None`" in setter and (cls.__name__, key) not in DEFAULTED:
                required.append(key)
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        if required:
            schema["required"] = required
        return schema

    root = of("KubeflowOrgV1TFJob")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **root,
        "$defs": closed(dict(sorted(defs.items()))),
    }


def write(name: str, schema: dict[str, Any], source: str) -> None:
    path = HERE / name
    made = {"$comment": f"Made by tests/schemas/make.py from {source}; do not edit.", **schema}
    path.write_text(json.dumps(made, indent=1, sort_keys=True) + "\n")
    print(f"{path.relative_to(HERE.parent.parent)}: {path.stat().st_size} bytes")


def main() -> None:
    for package, version in sources().items():  # the files say which versions
        installed = metadata.version(package)
        assert installed == version, (
            f"{package} {installed} is installed, sources.txt pins {version}"
        )
    versions = kubernetes_versions()
    newest = all_kubernetes_definitions(versions[-1])
    crds = {"jobset-v1alpha2.json": jobset_schema(newest), "tfjob-v1.json": tfjob_schema(newest)}
    roots = set(ROOTS).union(*(kubernetes_refs(schema) for schema in crds.values()))
    pins = sources()
    for version in versions:
        source = f"kubernetes-validate {pins['kubernetes-validate']} (v{version}-local-strict)"
        write(f"kubernetes-{version}.json", kubernetes_schema(version, roots), source)
    write(
        "jobset-v1alpha2.json",
        crds["jobset-v1alpha2.json"],
        f"kubeflow-trainer-api {pins['kubeflow-trainer-api']} (JobsetV1alpha2JobSet)",
    )
    write(
        "tfjob-v1.json",
        crds["tfjob-v1.json"],
        f"kubeflow-training {pins['kubeflow-training']} (KubeflowOrgV1TFJob)",
    )


if __name__ == "__main__":
    main()
