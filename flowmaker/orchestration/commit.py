"""Commit and release planning: decisions as data, turned into ONE guarded state-store transaction.

`plan_commit` turns a selected variant into a `CommitPlan` (deploy these new instances on these GPUs,
reuse these running ones with this load: under BUSY_TIME its busy-time equivalent, `busy_load_scale`);
`commit_ops` turns the plan plus the cluster view the
selector saw into the compares and puts of one transaction that
- re-checks, at that view's mod_revisions, every GPU key a new instance lands on and every reused
  instance's key (whose record carries its load and is rewritten whenever a reuse mapping changes),
  and the task's own key;
- reserves GPU memory (GPU records' memory_used_gb += memory_gb_per_gpu, per shard), records each new
  instance as PENDING (a deployer adopts it on Deploy with request_id = its id), adds each reused
  instance's load to its record, writes one reuse mapping per (instance, task), and moves the task.
If any compared key moved, nothing is written and the caller selects again on a fresh view, so two
concurrent approvals can never over-commit a GPU or an instance. The memory arithmetic is re-checked
here too (NoCapacity), so even a wrong selection cannot push a GPU past its capacity.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from flowmaker.domain import Instance, Profile, Variant, Workflow
from flowmaker.errors import InvalidSpec, NoCapacity
from flowmaker.orchestration.task import DeployedInstance, TaskRecord, replica_slot
from flowmaker.selection.placement import EPS_GB
from flowmaker.state import keys
from flowmaker.state.records import ClusterView, InstanceRecord, InstanceState, reuse_value
from flowmaker.state.store import Compare, KeyValue, Put


@dataclass(frozen=True, slots=True)
class ReuseAction:
    """Add `load` output tokens/s of this task to a running instance."""

    instance_id: str
    load_output_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class CommitPlan:
    """What approving a task does to the cluster: deploy X, reuse Y (and which instance serves each stage)."""

    task_id: str
    deploy: tuple[DeployedInstance, ...]
    reuse: tuple[ReuseAction, ...]
    stage_instances: dict[str, str]

    def describe(self) -> str:
        """One log line."""
        d = ", ".join(f"{x.instance_id}={x.model_id} tp{x.tp}pp{x.pp}@{x.node}:{'+'.join(x.gpu_ids)}"
                      for x in self.deploy) or "-"
        r = ", ".join(f"{x.instance_id}(+{x.load_output_tokens_per_s:g} tok/s)" for x in self.reuse) or "-"
        return f"task {self.task_id}: deploy [{d}] reuse [{r}]"


@dataclass(frozen=True, slots=True)
class ReleaseAction:
    """Drop the task's reference to an instance; `stop` = no other task references it (the deployer stops it)."""

    instance_id: str
    node: str
    stop: bool


def plan_instances(plan: CommitPlan) -> list[Instance]:
    """The new instances of a commit plan as the placement will hold them (GPUs, profile, planned load)."""
    return [Instance(d.instance_id, d.model_id, d.tp, d.pp, d.gpu_ids, d.load_output_tokens_per_s)
            for d in plan.deploy]


def plan_commit(task_id: str, variant: Variant, new_ids: Sequence[str], *,
                load_scale: Mapping[tuple[str, int, int], float] | None = None) -> CommitPlan:
    """The plan of a selected variant; `new_ids[i]` names the variant's i-th new instance.

    `load_scale` (by (model, tp, pp)) turns the variant's loads into the planned loads recorded per instance:
    under BUSY_TIME, `busy_load_scale` of the variant's workflow, so that what is recorded is the busy-time
    equivalent (output tokens/s at the profile's reference request keeping the same busy fraction), which is how
    later selections read running loads; None (or a key it lacks): the loads as selected (output tokens/s)."""
    if len(new_ids) != len(variant.new_instances):
        raise InvalidSpec(f"need {len(variant.new_instances)} instance ids, got {len(new_ids)}", field="new_ids")
    scale = load_scale or {}
    by_key = {n.key: iid for n, iid in zip(variant.new_instances, new_ids, strict=True)}
    deploy = tuple(DeployedInstance(iid, n.key, n.model_id, n.tp, n.pp, n.node, n.gpu_ids, n.memory_gb_per_gpu,
                                    n.load_output_tokens_per_s * scale.get((n.model_id, n.tp, n.pp), 1.0))
                   for n, iid in zip(variant.new_instances, new_ids, strict=True))
    reused_key = {a.instance_id: (a.model_id, a.tp, a.pp) for a in variant.assignments if a.reused}
    loads: dict[str, float] = defaultdict(float)
    for iid, load in variant.reuse:
        k = reused_key.get(iid)
        loads[iid] += load * (scale.get(k, 1.0) if k is not None else 1.0)
    stage_instances: dict[str, str] = {}
    for a in variant.assignments:
        if a.reused:
            stage_instances[a.stage_id] = a.instance_id
        else:
            if a.new_key not in by_key:
                raise InvalidSpec(f"stage {a.stage_id!r} names unknown new instance {a.new_key!r}",
                                  field="variant.assignments")
            stage_instances[a.stage_id] = by_key[a.new_key]
            for i, key in enumerate(a.replica_keys[1:], 1):  # a replica group: the others beside the first
                if key not in by_key:
                    raise InvalidSpec(f"stage {a.stage_id!r} names unknown replica {key!r}",
                                      field="variant.assignments")
                stage_instances[replica_slot(a.stage_id, i)] = by_key[key]
    reuse = tuple(ReuseAction(iid, loads[iid]) for iid in sorted(loads))
    return CommitPlan(task_id, deploy, reuse, stage_instances)


def busy_load_scale(workflow: Workflow, profiles: Iterable[Profile]) -> dict[tuple[str, int, int], float]:
    """By (model, tp, pp): max_output_tokens_per_s / busy_capacity at `workflow`'s mean request
    (flowmaker.selection.busytime), the factor that turns a BUSY_TIME selection's load (output tokens/s of this
    workflow) into its busy-time equivalent, as `flowmaker.eval.policies.planned_load` does."""
    from flowmaker.selection.busytime import busy_capacity, mean_request

    prompt, output = mean_request(workflow)
    out: dict[tuple[str, int, int], float] = {}
    for p in profiles:
        cap = busy_capacity(p, prompt, output)
        if cap > 0 and math.isfinite(cap) and p.max_output_tokens_per_s > 0:
            out[p.key] = p.max_output_tokens_per_s / cap
    return out


def commit_ops(plan: CommitPlan, view: ClusterView, task_kv: KeyValue, task: TaskRecord,
               now: float, *, held: dict[str, float] | None = None) -> tuple[list[Compare], list[Put]]:
    """Compares and puts of the one transaction committing `plan` on `view` and writing `task`.

    `held` (a re-selection of a task that already serves): the task's current reuse loads by instance id.
    Reusing one of those again rewrites its reference with the new load (the instance's planned load moves
    by the difference) instead of requiring the reference to be absent.

    Raises NoCapacity when the plan does not fit `view` (a GPU would exceed its memory, a GPU or reused
    instance is not in the view); the caller then treats it like a lost race and selects again."""
    compares = [Compare.unchanged(task_kv.key, task_kv.mod_revision)]
    puts = [Put(task_kv.key, task.to_json())]
    add: dict[str, float] = defaultdict(float)
    for d in plan.deploy:
        for gid in d.gpu_ids:
            add[gid] += d.memory_gb_per_gpu
    for gid in sorted(add):
        g = view.gpus.get(gid)
        if g is None:
            raise NoCapacity(f"GPU {gid} is not in the live cluster", field="variant.new_instances")
        if g.memory_used_gb + add[gid] > g.memory_total_gb + EPS_GB:
            raise NoCapacity(f"GPU {gid}: {g.memory_used_gb:g} GB used + {add[gid]:g} GB would exceed "
                             f"{g.memory_total_gb:g} GB", field="variant.new_instances")
        gkey = keys.gpu(g.node, gid)
        compares.append(Compare.unchanged(gkey, view.etags[gkey]))
        puts.append(Put(gkey, g.with_used(add[gid]).to_json()))
    for d in plan.deploy:
        ikey = keys.instance(d.instance_id)
        rec = InstanceRecord(d.instance_id, d.model_id, d.tp, d.pp, d.node, d.gpu_ids, d.memory_gb_per_gpu,
                             InstanceState.PENDING, load_output_tokens_per_s=d.load_output_tokens_per_s,
                             memory_reserved=True, created_at=now)
        compares.append(Compare.absent(ikey))
        puts.append(Put(ikey, rec.to_json()))
        rkey = keys.reuse(d.instance_id, plan.task_id)
        compares.append(Compare.absent(rkey))
        puts.append(Put(rkey, reuse_value(d.instance_id, plan.task_id, d.load_output_tokens_per_s)))
    held = held or {}
    for r in plan.reuse:
        inst = view.instances.get(r.instance_id)
        if inst is None:
            raise NoCapacity(f"instance {r.instance_id} is no longer live", field="variant.reuse")
        ikey = keys.instance(r.instance_id)
        compares.append(Compare.unchanged(ikey, view.etags[ikey]))
        # The view's load is the sum of the reuse mappings; the record keeps that sum too.
        old = held.get(r.instance_id, 0.0)
        puts.append(Put(ikey, replace(inst, load_output_tokens_per_s=round(max(
            0.0, inst.load_output_tokens_per_s - old + r.load_output_tokens_per_s), 6)).to_json()))
        rkey = keys.reuse(r.instance_id, plan.task_id)
        compares.append(Compare.present(rkey) if r.instance_id in held else Compare.absent(rkey))
        puts.append(Put(rkey, reuse_value(r.instance_id, plan.task_id, r.load_output_tokens_per_s)))
    return compares, puts


def plan_release(task: TaskRecord, instances: dict[str, InstanceRecord],
                 references: Iterable[tuple[str, str]]) -> tuple[ReleaseAction, ...]:
    """What deleting (or rolling back) `task` releases: each instance it references, on its node, and
    whether that was the last reference (then the deployer stops it). `instances` are the current
    records by id (an instance absent there is gone already: nothing to release); `references` are
    (instance id, task id) pairs from the reuse keys."""
    others: dict[str, set[str]] = defaultdict(set)
    for iid, tid in references:
        if tid != task.id:
            others[iid].add(tid)
    ids = set(task.instance_ids) | {d.instance_id for d in task.new_instances}
    return tuple(ReleaseAction(iid, instances[iid].node, not others[iid])
                 for iid in sorted(ids) if iid in instances)
