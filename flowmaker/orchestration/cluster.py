"""The live cluster and profiles as the selector sees them, built from state-store records (no gRPC, no etcd client).

Two readers used by both the selector and the orchestrator:

* `read_live_cluster(store)` -> the deployer's `ClusterView` (alive nodes' GPUs with memory_used, their
  PENDING/STARTING/READY instances, and the etag of every key read) with each instance's load set by
  the load rule (`effective_load`): max(planned load = the sum of its reuse mappings
  (`keys.reuse(instance, task)` values), observed load = the deployer's measurement, when fresh).
* `read_profiles(store, gpu_type, models)` -> one profile per deployable (model, tp, pp): MEASURED
  records from the store win over ANALYTIC ones, and models with no stored profile at all get the
  analytic roofline profiles (`flowmaker.profiling.analytic.profiles_for`).

And what GPU sharing needs besides (docs/selection-spec.md, "Extension: GPU sharing"): each instance's measured
busy share (`fresh_busy_share`, put into the view by `with_loads`) and the slowdown the tasks using it tolerate
(`read_tolerated_slowdowns` -> `with_tolerances`: SLO / the task's latency alone, the least over its tasks), and
its busy share at the planned rates (`planned_busy_shares` -> `with_planned_busy`: occupancy of the call-seconds
per second its tasks offer it alone; what the selector assumes before traffic arrives, the measured share winning
when higher). Both come from one pass over the committed variants (`task_uses` / `read_task_uses`).

They take the `StateStore` protocol, so they run unchanged against etcd or the in-memory store.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace

from flowmaker.domain import Cluster, Model, Profile, ProfileSource, Variant, Workflow
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.orchestration.task import REPLICA_SEP, TaskRecord, TaskState
from flowmaker.sharing import occupancy
from flowmaker.state import keys
from flowmaker.state.records import ClusterView, InstanceRecord, read_cluster, reuse_load
from flowmaker.state.store import KeyValue, StateStore

log = logging.getLogger(__name__)

# Preference when the store holds several profiles of one (model, tp, pp): higher wins.
_SOURCE_RANK = {ProfileSource.ANALYTIC: 0, ProfileSource.MEASURED: 1}
_PROFILE_FIELDS = {f.name for f in fields(Profile)}
_CAMEL = re.compile(r"(?<=.)([A-Z])")

# How old (wall seconds, by the record's `observed_load_at`) an observed load may be and still count. The
# deployer scrapes every 2 s and rewrites a non-zero observation at least every 5 s
# (FLOWMAKER_DEPLOYER_LOAD_REPORT_MAX_INTERVAL_S), so 15 s tolerates two missed writes; older means the
# scrapes fail (a hung engine) and the last value can no longer be trusted.
OBSERVED_LOAD_MAX_AGE_S = 15.0


def loads_from_reuse(items: Iterable[KeyValue]) -> dict[str, float]:
    """Sum of reuse loads per instance id, from the items under `keys.REUSE`."""
    out: dict[str, float] = {}
    for kv in items:
        try:
            iid, _task = keys.parse_reuse(kv.key)
        except Exception:  # a foreign key under the prefix must not break reads
            continue
        out[iid] = out.get(iid, 0.0) + reuse_load(kv.value)
    return out


def fresh_observed_load(rec: InstanceRecord, now: float, max_age_s: float = OBSERVED_LOAD_MAX_AGE_S) -> float | None:
    """The record's observed load (output tokens/s, model seconds) if it was measured at most `max_age_s`
    ago, else None. A timestamp slightly in the future (clock skew between nodes) counts as fresh;
    `max_age_s <= 0` ignores observations altogether (the plan-only rule)."""
    if max_age_s <= 0 or rec.observed_load_at <= 0 or now - rec.observed_load_at > max_age_s:
        return None
    return max(0.0, rec.observed_load_output_tokens_per_s)


def fresh_busy_share(rec: InstanceRecord, now: float, max_age_s: float = OBSERVED_LOAD_MAX_AGE_S) -> float:
    """The record's measured busy share (in [0, 1]) when it is fresh by the same rule as the observed load (the
    deployer writes both in one scrape, under `observed_load_at`), else 0: unknown, which the selector's
    GPU-sharing model replaces by its own estimate (docs/selection-spec.md, "Extension: GPU sharing")."""
    if fresh_observed_load(rec, now, max_age_s) is None:
        return 0.0
    b = rec.observed_busy_share
    return min(1.0, max(0.0, b)) if math.isfinite(b) else 0.0


# The load a saturated instance is given in the selector's view: far above any instance's capacity, so it
# offers no headroom (finite: the request's validation wants finite numbers).
SATURATED_LOAD_TOK_S = 1e9


def effective_load(planned: float, observed: float | None) -> float:
    """The load the selector must assume on a running instance: max(planned, observed).

    Planned (the sum of the tasks' reuse loads) alone misses traffic above plan: measured loads have
    been seen ~9x the plan (1,672 vs 182 tok/s), and an instance full by measurement must not be
    offered to one more task. Observed alone would hand out capacity already promised to tasks whose
    traffic has not arrived yet (a task just approved, or a bursty one between bursts). The max keeps
    both promises; `None` (no fresh observation) falls back to the plan."""
    planned = max(0.0, planned)
    return planned if observed is None else max(planned, observed)


def with_loads(view: ClusterView, loads: dict[str, float], *, now: float | None = None,
               observed_max_age_s: float = OBSERVED_LOAD_MAX_AGE_S) -> ClusterView:
    """The view with each instance's load set by the load rule. `loads` are the planned loads (the sum of
    the reuse mappings; 0 when an instance has none). The domain `cluster` carries the effective load
    (what the selector checks capacity against) and the measured busy share when fresh (`fresh_busy_share`;
    0 = unknown); the `instances` records carry the planned load, which is what a commit adds the new
    task's planned load to (`commit_ops`), so the stored plan never absorbs a transient measurement."""
    now = time.time() if now is None else now
    planned = {iid: loads.get(iid, 0.0) for iid in view.instances}
    observed = {iid: o for iid, rec in view.instances.items()
                if (o := fresh_observed_load(rec, now, observed_max_age_s)) is not None}
    for iid, rec in view.instances.items():
        if iid in observed and rec.saturated:
            # Measured full (queue building or latency stretched): no headroom, whatever the throughput says.
            observed[iid] = SATURATED_LOAD_TOK_S
    insts = {iid: replace(rec, load_output_tokens_per_s=planned[iid]) for iid, rec in view.instances.items()}
    cluster = Cluster(view.cluster.gpus, tuple(
        replace(insts[i.id].to_domain(), load_output_tokens_per_s=effective_load(planned[i.id], observed.get(i.id)),
                busy_share=fresh_busy_share(insts[i.id], now, observed_max_age_s))
        for i in view.cluster.instances))
    return replace(view, cluster=cluster, instances=insts, planned_loads=planned, observed_loads=observed)


def excluding_task(view: ClusterView, held: dict[str, float]) -> ClusterView:
    """The view as a re-selection of a serving task sees it: its own planned share (`held`, by instance id)
    taken off the instances it uses, which it may keep at its new rate. The records (what a commit adds the
    new share to, after taking the old one off) are left as they are."""
    reduced = {iid: max(0.0, p - held.get(iid, 0.0)) for iid, p in view.planned_loads.items()}
    return replace(with_loads(view, reduced), instances=view.instances, planned_loads=view.planned_loads)


async def read_live_cluster(store: StateStore, *, observed_max_age_s: float = OBSERVED_LOAD_MAX_AGE_S,
                            now: float | None = None) -> ClusterView:
    """Alive GPUs and instances (with etags for the commit), each instance's load = max(planned from the
    reuse mappings, observed by its deployer if at most `observed_max_age_s` old; 0 = plan only).

    The reuse keys are read after the instances: a commit that adds or drops a reuse mapping also
    rewrites the instance's record, so a mapping changed in between moves the instance's etag and
    aborts any commit based on this view. The deployer's load reports also rewrite the record, so a
    commit reusing an instance whose measured load moved meanwhile aborts and selects again on the
    new measurement."""
    view = await read_cluster(store)
    reuse = await store.get_prefix(keys.REUSE)
    return with_loads(view, loads_from_reuse(reuse.items), now=now, observed_max_age_s=observed_max_age_s)


# Tasks whose SLO protects the instances they use: they hold a committed variant (DEPLOYING: its instances
# starting or reused; ACTIVE: serving, DEGRADED included, as that state is derived on read).
TOLERATING_STATES = (TaskState.DEPLOYING, TaskState.ACTIVE)


def stage_latencies_alone(workflow: Workflow, variant: Variant, profiles: Mapping[tuple[str, int, int], Profile]
                          ) -> dict[str, float | None] | None:
    """Each stage's own latency without GPU sharing (Feasibility 2 of docs/selection-spec.md): an LLM stage takes
    calls_per_request x its profile's call latency (from its assignment and `profiles`, by (model, tp, pp); None
    when either is unknown), a TOOL stage its latency_s. None when the variant is not of `workflow`."""
    if variant.workflow_id != workflow.id:
        return None
    by_stage = {a.stage_id: a for a in variant.assignments}
    out: dict[str, float | None] = {}
    for s in workflow.stages:
        if s.is_llm:
            a = by_stage.get(s.id)
            p = profiles.get((a.model_id, a.tp, a.pp)) if a is not None else None
            out[s.id] = None if p is None else s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens)
        else:
            out[s.id] = s.latency_s
    return out


def longest_path_s(workflow: Workflow, own: Mapping[str, float | None]) -> float | None:
    """The longest path through `workflow`'s DAG with these stage latencies (None when one is unknown)."""
    done: dict[str, float] = {}
    for i in workflow.topo_order():
        s = workflow.stages[i]
        lat = own.get(s.id)
        if lat is None:
            return None
        done[s.id] = max((done.get(d, 0.0) for d in s.depends_on), default=0.0) + lat
    return max(done.values(), default=0.0)


def alone_latency_s(workflow: Workflow, variant: Variant, profiles: Mapping[tuple[str, int, int], Profile]
                    ) -> float | None:
    """The variant's latency without GPU sharing: Feasibility 2 of docs/selection-spec.md (an LLM stage takes
    calls_per_request x its profile's call latency, a TOOL stage its latency_s; the longest path through the
    DAG). Under `INTERFERENCE` the variant's own `latency_s` is the slowed one, so this is recomputed from its
    assignments and `profiles` (by (model, tp, pp)). None when a stage's assignment or profile is unknown."""
    own = stage_latencies_alone(workflow, variant, profiles)
    return None if own is None else longest_path_s(workflow, own)


@dataclass(frozen=True, slots=True)
class TaskUse:
    """What one committed variant of a task (its current one, or its next one during a make-before-break switch)
    asks of the instances it uses, without GPU sharing:

    * `alone_s`: the variant's latency alone (`alone_latency_s`; None when unknown);
    * `offered`: by instance id, the call-seconds per second it offers there: over the LLM stages mapped to the
      instance, the rate the variant is planned for x the stage's latency alone, divided by the stage's
      replica count (a stage whose profile is unknown offers nothing known and is left out);
    * `instances`: every instance the variant uses."""

    task_id: str
    slo_latency_s: float
    alone_s: float | None
    offered: dict[str, float]
    instances: frozenset[str]


def task_uses(tasks: Iterable[TaskRecord], profiles: Mapping[tuple[str, int, int], Profile], *,
              exclude: str = "") -> Iterator[TaskUse]:
    """One `TaskUse` per committed variant of the tasks holding one (`TOLERATING_STATES`; `exclude` left out):
    the current variant at the rate it was planned for (`TaskRecord.plan_rate_rps`) and, during a switch, the
    next one at the rate of the re-selection that chose it (else the same)."""
    for t in tasks:
        if t.id == exclude or t.state not in TOLERATING_STATES:
            continue
        next_rate = t.last_reselection.rate_rps if t.last_reselection is not None and \
            t.last_reselection.rate_rps > 0 else t.plan_rate_rps
        for v, stage_instances, rate in ((t.variant, t.stage_instances, t.plan_rate_rps),
                                         (t.next_variant, t.next_stage_instances, next_rate)):
            if v is None or not stage_instances:
                continue
            wf = next((w for w in t.candidates if w.id == v.workflow_id), None)
            own = stage_latencies_alone(wf, v, profiles) if wf is not None else None
            alone = longest_path_s(wf, own) if wf is not None and own is not None else None
            offered: dict[str, float] = {}
            if wf is not None and own is not None and rate > 0 and math.isfinite(rate):
                by_stage: dict[str, list[str]] = {}
                for slot, iid in stage_instances.items():
                    by_stage.setdefault(slot.split(REPLICA_SEP, 1)[0], []).append(iid)
                for s in wf.stages:
                    lat = own.get(s.id)
                    iids = by_stage.get(s.id, [])
                    if not s.is_llm or lat is None or not iids or not math.isfinite(lat):
                        continue
                    for iid in iids:
                        offered[iid] = offered.get(iid, 0.0) + rate * lat / len(iids)
            yield TaskUse(t.id, t.slo.max_latency_s, alone, offered, frozenset(stage_instances.values()))


def tolerated_slowdowns(tasks: Iterable[TaskRecord], profiles: Mapping[tuple[str, int, int], Profile], *,
                        exclude: str = "") -> dict[str, float]:
    """`Instance.max_slowdown` by instance id: the least, over the tasks holding a committed variant
    (`TOLERATING_STATES`; `exclude` left out: the task being re-selected answers for itself through the
    selector's latency check) that use the instance, of the task's latency SLO / its variant's latency alone
    (`alone_latency_s`; at least 1). During a make-before-break switch both the current and the next variant
    count. A task whose alone latency is unknown (a profile gone, an unreadable variant) bounds nothing; an
    instance no task bounds is absent (0 = unbounded)."""
    return tolerances_of(task_uses(tasks, profiles, exclude=exclude))


def tolerances_of(uses: Iterable[TaskUse]) -> dict[str, float]:
    """`tolerated_slowdowns` from the tasks' uses."""
    out: dict[str, float] = {}
    for u in uses:
        if u.alone_s is None or not (u.alone_s > 0 and math.isfinite(u.alone_s)):
            continue
        tol = max(1.0, u.slo_latency_s / u.alone_s)
        if not math.isfinite(tol):
            continue
        for iid in u.instances:
            out[iid] = min(out.get(iid, tol), tol)
    return out


def planned_busy_shares(uses: Iterable[TaskUse]) -> dict[str, float]:
    """By instance id, its busy share at the planned rates: `flowmaker.sharing.occupancy(N)`, N the call-seconds
    per second the tasks' variants offer it (`TaskUse.offered`, summed). What the selector assumes of an
    instance before (or beside) a measurement: a freshly deployed instance has none until traffic arrives."""
    offered: dict[str, float] = {}
    for u in uses:
        for iid, n in u.offered.items():
            offered[iid] = offered.get(iid, 0.0) + n
    return {iid: occupancy(n) for iid, n in offered.items() if n > 0}


def with_tolerances(cluster: Cluster, tolerated: Mapping[str, float]) -> Cluster:
    """The cluster with each running instance's `max_slowdown` set from `tolerated` (others: 0, unbounded)."""
    return replace(cluster, instances=tuple(replace(i, max_slowdown=tolerated.get(i.id, 0.0))
                                            for i in cluster.instances))


def protected(cluster: Cluster, ids: Iterable[str], capacity: Mapping[str, float]) -> Cluster:
    """The cluster with the instances `ids` protected from a selection, whatever kappa it uses (a tolerance alone
    binds only where the selector's model sees a slowdown): each tolerates no slowdown (`max_slowdown` 1) and
    carries at least its capacity (`capacity`, by id; an id without one keeps its load), so that it has no room to
    reuse and its GPUs no compute left for more load; and its GPUs show no free memory, so that LeastLoaded, which
    places by memory, puts no new instance there."""
    ids = set(ids)
    full = {g for i in cluster.instances if i.id in ids for g in i.gpu_ids}
    return replace(
        cluster,
        gpus=tuple(replace(g, memory_used_gb=g.memory_total_gb) if g.id in full else g for g in cluster.gpus),
        instances=tuple(replace(i, max_slowdown=1.0, load_output_tokens_per_s=max(i.load_output_tokens_per_s,
                                                                                   capacity.get(i.id, 0.0)))
                        if i.id in ids else i for i in cluster.instances))


def with_planned_busy(cluster: Cluster, planned: Mapping[str, float]) -> Cluster:
    """The cluster with each running instance's `busy_share` = max(its planned busy share (`planned_busy_shares`;
    0 when absent), the one it carries: the measured share when fresh, else 0)."""
    return replace(cluster, instances=tuple(
        replace(i, busy_share=min(1.0, max(i.busy_share, planned.get(i.id, 0.0)))) for i in cluster.instances))


async def read_tolerating_tasks(store: StateStore, *, exclude: str = "") -> list[TaskRecord]:
    """The stored task records that hold a committed variant (TOLERATING_STATES), but `exclude`; an unreadable record
    is skipped with a warning (one must not break selections)."""
    tasks: list[TaskRecord] = []
    for kv in (await store.get_prefix(keys.TASKS)).items:
        try:
            t = TaskRecord.from_json(kv.value)
        except Exception as e:
            log.warning("ignoring unreadable task record %s: %s", kv.key, e)
            continue
        if t.state in TOLERATING_STATES and t.id != exclude:
            tasks.append(t)
    return tasks


async def read_task_uses(store: StateStore, gpu_type: str, models: Sequence[Model], *,
                         exclude: str = "") -> list[TaskUse]:
    """`task_uses` over the stored task records, with the profiles the selector sees for `models` on `gpu_type`
    (`read_profiles`: stored MEASURED first, else analytic). A model outside `models`, or a GPU type the catalog
    does not know (no analytic profiles) leaves the tasks using it with an unknown latency alone and nothing
    offered."""
    tasks = await read_tolerating_tasks(store, exclude=exclude)
    used = {(a.model_id, a.tp, a.pp) for t in tasks for v in (t.variant, t.next_variant) if v is not None
            for a in v.assignments}
    if not used:
        return []
    try:
        profiles = await read_used_profiles(store, gpu_type, models, used)
    except (NotFound, InvalidSpec) as e:
        log.warning("no profiles on GPU type %r to bound co-residents' slowdown: %s", gpu_type, e)
        return []
    return list(task_uses(tasks, profiles))


async def read_tolerated_slowdowns(store: StateStore, gpu_type: str, models: Sequence[Model], *,
                                   exclude: str = "") -> dict[str, float]:
    """`tolerated_slowdowns` over the stored task records (`read_task_uses`)."""
    return tolerances_of(await read_task_uses(store, gpu_type, models, exclude=exclude))


async def read_used_profiles(store: StateStore, gpu_type: str, models: Sequence[Model],
                             used: Iterable[tuple[str, int, int]]) -> dict[tuple[str, int, int], Profile]:
    """The profiles the selector sees (`read_profiles`) of the (model, tp, pp) in `used`, by key; models outside
    `models` have none. Raises NotFound / InvalidSpec as `read_profiles` does."""
    used = set(used)
    wanted = [m for m in models if m.id in {u[0] for u in used}]
    if not wanted:
        return {}
    profiles = await read_profiles(store, gpu_type, wanted, max_gpus=max(8, max(u[1] * u[2] for u in used)))
    return {p.key: p for p in profiles if p.key in used}


def cluster_gpu_type(cluster: Cluster, default: str) -> str:
    """The GPU type of the cluster (the most common one when mixed, which the spec does not model)."""
    types = Counter(g.gpu_type for g in cluster.gpus if g.gpu_type)
    return types.most_common(1)[0][0] if types else default


def profile_from_record(kv: KeyValue) -> Profile | None:
    """A Profile stored under `keys.profile(...)`: the Profile fields as JSON (source as its name);
    the key's components fill in whatever the value leaves out. None when unreadable."""
    try:
        gpu_type, model_id, tp, pp, source = keys.parse_profile(kv.key)
    except Exception:
        return None
    v = kv.value
    if isinstance(v, dict) and isinstance(v.get("profile"), dict):  # {"profile": {...}, ...} wrappers
        v = v["profile"]
    if not isinstance(v, dict):
        return None
    # Proto JSON may spell the fields lowerCamel (memoryGbPerGpu); the domain's names are snake_case.
    d = {n: v[k] for k in v if (n := _CAMEL.sub(r"_\1", k).lower()) in _PROFILE_FIELDS}
    d.update(model_id=model_id, tp=tp, pp=pp, gpu_type=d.get("gpu_type") or gpu_type)
    try:
        d["source"] = ProfileSource(str(d.get("source") or source).upper().removeprefix("PROFILE_SOURCE_"))
        p = Profile(**d)
        return p.validate()
    except Exception as e:  # one bad record must not hide the others; say which
        log.warning("ignoring unreadable profile record %s: %s", kv.key, e)
        return None


def merge_profiles(stored: Iterable[Profile], models: Sequence[Model], analytic: Sequence[Profile]) -> tuple[Profile, ...]:
    """One profile per (model, tp, pp) of `models`: stored MEASURED beats stored ANALYTIC; a model with
    no stored profile gets its `analytic` ones. Ordered by model order, then tp*pp, tp."""
    wanted = {m.id for m in models}
    best: dict[tuple[str, int, int], Profile] = {}
    for p in stored:
        if p.model_id not in wanted:
            continue
        cur = best.get(p.key)
        if cur is None or _SOURCE_RANK[p.source] > _SOURCE_RANK[cur.source]:
            best[p.key] = p
    have = {k[0] for k in best}
    for p in analytic:
        if p.model_id not in have and p.key not in best:
            best[p.key] = p
    order = {m.id: i for i, m in enumerate(models)}
    return tuple(sorted(best.values(), key=lambda p: (order[p.model_id], p.tp * p.pp, p.tp)))


async def read_profiles(store: StateStore, gpu_type: str, models: Sequence[Model], *,
                        max_gpus: int = 8) -> tuple[Profile, ...]:
    """Profiles of `models` on `gpu_type`: the store's (MEASURED preferred), else analytic."""
    from flowmaker.catalog import get_gpu_type
    from flowmaker.profiling.analytic import profiles_for

    listing = await store.get_prefix(keys.profiles_of_gpu_type(gpu_type))
    stored = [p for p in (profile_from_record(kv) for kv in listing.items) if p is not None]
    have = {p.model_id for p in stored}
    missing = [m for m in models if m.id not in have]
    analytic = profiles_for(missing, get_gpu_type(gpu_type), max_gpus) if missing else ()
    return merge_profiles(stored, models, analytic)
