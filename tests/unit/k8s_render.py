"""A small kustomize renderer for the features deploy/kubernetes uses, so CI can build the manifests without
kubectl: `resources` (files and directories), `namespace`, `commonLabels` (metadata, selectors, pod
templates), `images`, `patchesStrategicMerge` (lists of named items merged by `name`, as Kubernetes'
patch merge keys for containers, env, volumes and ports do; a `null` value deletes the field and a named
item with `$patch: delete` the item, as strategic merge patches do) and `configMapGenerator` (files and
literals, hash suffix disabled). Anything else in a kustomization is an error, so the manifests cannot quietly rely
on a feature this renderer ignores.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "commonLabels", "images", "patchesStrategicMerge",
             "configMapGenerator"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}


def _load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out_l = [copy.deepcopy(x) for x in base]
        for item in patch:
            i = next((j for j, x in enumerate(out_l) if x["name"] == item["name"]), None)
            if item.get("$patch") == "delete":
                if i is None:
                    raise ValueError(f"$patch: delete of {item['name']!r}, which is not there")
                del out_l[i]
            elif "$patch" in item:
                raise ValueError(f"$patch: {item['$patch']!r} is not rendered (only delete)")
            elif i is None:
                out_l.append(copy.deepcopy(item))
            else:
                out_l[i] = _merge(out_l[i], item)
        return out_l
    return copy.deepcopy(patch)


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc.get("kind") in WORKLOADS:
        return [doc["spec"]["template"]["spec"]]
    if doc.get("kind") == "CronJob":
        return [doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    return []


def _add_labels(doc: dict[str, Any], labels: dict[str, str]) -> None:
    doc.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    spec = doc.get("spec") or {}
    kind = doc.get("kind")
    if kind in WORKLOADS:
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(labels)
        spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(labels)
        for vct in spec.get("volumeClaimTemplates", []):
            vct.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    elif kind == "Service" and spec.get("selector") is not None:
        spec["selector"].update(labels)
    elif kind == "PodDisruptionBudget":
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(labels)


def _set_images(doc: dict[str, Any], images: list[dict[str, str]]) -> None:
    for ps in _pod_specs(doc):
        for c in [*ps.get("initContainers", []), *ps.get("containers", [])]:
            name, _, tag = c["image"].partition(":")
            for img in images:
                if img["name"] == name:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"


def render(directory: Path) -> list[dict[str, Any]]:
    """The manifests `kubectl kustomize directory` would print (for the supported features)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml uses {sorted(unknown)}, which tests/unit/kustomize.py "
                         "does not render")
    docs: list[dict[str, Any]] = []
    for r in k.get("resources", []):
        p = directory / r
        docs.extend(render(p) if p.is_dir() else _load_docs(p))
    for gen in k.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in gen.get("files", [])}
        data.update(dict(lit.split("=", 1) for lit in gen.get("literals", [])))
        opts = gen.get("options", {})
        if not opts.get("disableNameSuffixHash"):
            raise ValueError("configMapGenerator: only disableNameSuffixHash: true is rendered")
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": gen["name"], **({"labels": dict(opts["labels"])} if "labels" in opts else {})},
                     "data": data})
    for pf in k.get("patchesStrategicMerge", []):
        for patch in _load_docs(directory / pf):
            matches = [i for i, d in enumerate(docs) if d["kind"] == patch["kind"]
                       and d["metadata"]["name"] == patch["metadata"]["name"]]
            if len(matches) != 1:
                raise ValueError(f"{pf}: patch target {patch['kind']}/{patch['metadata']['name']} matched "
                                 f"{len(matches)} resources")
            docs[matches[0]] = _merge(docs[matches[0]], patch)
    if "commonLabels" in k:
        for d in docs:
            _add_labels(d, k["commonLabels"])
    if "images" in k:
        for d in docs:
            _set_images(d, k["images"])
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return docs
