"""Regenerate pytorchjob-v1.schema.json: Kubeflow's PyTorchJob model as a strict JSON Schema.

The schema is derived from the published SDK models (PyPI), not written by hand: the Kubeflow
Training SDK's `KubeflowOrgV1PyTorchJob` and the Kubernetes Python client's models it refers to
(pod template, containers, volumes...). Each model class declares `openapi_types` (attribute ->
type) and `attribute_map` (attribute -> JSON key); an attribute its `__init__` sets without a
`None` guard is required. Every object is closed (`additionalProperties: false`), as a strict
apiserver (`kubectl apply --validate=strict`) refuses unknown fields. Read with `ast`: nothing
from the wheels is imported or run.

    pip download --no-deps -d /tmp/kf kubeflow-training==1.9.3 kubernetes==31.0.0
    python tests/infra/schemas/make_pytorchjob_schema.py /tmp/kf/kubeflow_training-*.whl \\
        /tmp/kf/kubernetes-*.whl > tests/infra/schemas/pytorchjob-v1.schema.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

ROOT = "KubeflowOrgV1PyTorchJob"
MODEL_DIRS = ("kubeflow/training/models/", "kubernetes/client/models/")
PRIMITIVES = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "datetime": {"type": "string"},
    "date": {"type": "string"},
    "object": {},  # IntOrString and free-form fields
    "Quantity": {"anyOf": [{"type": "integer"}, {"type": "string"}]},  # resource.Quantity: int or string
}


def models(wheel: Path) -> dict[str, dict]:
    """class name -> {"types": {attr: type}, "keys": {attr: json key}, "required": [attr]}."""
    found = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if not name.startswith(MODEL_DIRS) or not name.endswith(".py") or name.endswith("__init__.py"):
                continue
            for node in ast.parse(zf.read(name)).body:
                if isinstance(node, ast.ClassDef):
                    model = _model(node)
                    if model is not None:
                        found[node.name] = model
    return found


def _model(cls: ast.ClassDef) -> dict | None:
    values = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            if stmt.targets[0].id in ("openapi_types", "attribute_map"):
                values[stmt.targets[0].id] = ast.literal_eval(stmt.value)
    if set(values) != {"openapi_types", "attribute_map"}:
        return None
    init = next(s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__")
    required = [
        s.targets[0].attr
        for s in init.body  # `self.x = x` outside any `if x is not None:`
        if isinstance(s, ast.Assign)
        and isinstance(s.targets[0], ast.Attribute)
        and isinstance(s.value, ast.Name)
        and s.targets[0].attr == s.value.id
        and s.targets[0].attr in values["openapi_types"]
    ]
    return {"types": values["openapi_types"], "keys": values["attribute_map"], "required": required}


def type_schema(kind: str, wanted: set[str]) -> dict:
    kind = kind.strip()
    if kind in PRIMITIVES:
        return dict(PRIMITIVES[kind])
    if m := re.fullmatch(r"list\[(.+)\]", kind):
        return {"type": "array", "items": type_schema(m.group(1), wanted)}
    if m := re.fullmatch(r"dict\(str, (.+)\)", kind):
        return {"type": "object", "additionalProperties": type_schema(m.group(1), wanted)}
    kind = _client_name(kind)
    wanted.add(kind)
    return {"$ref": f"#/$defs/{kind}"}


def _client_name(kind: str) -> str:
    """The Kubeflow SDK names some Kubernetes types by their Go package (K8sIoApiAutoscalingV2MetricSpec);
    the Kubernetes client by version and kind (V2MetricSpec)."""
    m = re.fullmatch(r"K8sIoApi(?:machineryPkgApis)?[A-Z][a-z]+(V\d+(?:alpha\d+|beta\d+)?)(\w+)", kind)
    return m.group(1) + m.group(2) if m else kind


def schema(all_models: dict[str, dict]) -> dict:
    defs, todo, done = {}, {ROOT}, set()
    while todo:
        name = todo.pop()
        done.add(name)
        model = all_models[name]
        wanted: set[str] = set()
        props = {model["keys"][a]: type_schema(t, wanted) for a, t in model["types"].items()}
        entry = {"type": "object", "additionalProperties": False, "properties": props}
        required = sorted(model["keys"][a] for a in model["required"])
        if required:
            entry["required"] = required
        defs[name] = entry
        todo |= wanted - done
    return {"$ref": f"#/$defs/{ROOT}", "$defs": dict(sorted(defs.items()))}


def main(argv: list[str]) -> int:
    wheels = [Path(a) for a in argv]
    found: dict[str, dict] = {}
    for wheel in wheels:
        found |= models(wheel)
    out = schema(found)
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (
            "Kubeflow PyTorchJob (kubeflow.org/v1), strict: generated by make_pytorchjob_schema.py from the "
            "models of " + ", ".join(w.name for w in wheels) + " (PyPI)"
        ),
        **out,
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
