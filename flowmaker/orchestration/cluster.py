"""The live cluster and profiles as the selector sees them, built from state-store records (no gRPC, no etcd client).

Two readers used by both the selector and the orchestrator:

* `read_live_cluster(store)` -> the deployer's `ClusterView` (alive nodes' GPUs with memory_used, their
  PENDING/STARTING/READY instances, and the etag of every key read) with each instance's load replaced
  by the sum of its reuse mappings (`keys.reuse(instance, task)` values), the source of truth for load.
* `read_profiles(store, gpu_type, models)` -> one profile per deployable (model, tp, pp): MEASURED
  records from the store win over ANALYTIC ones, and models with no stored profile at all get the
  analytic roofline profiles (`flowmaker.profiling.analytic.profiles_for`).

They take the `StateStore` protocol, so they run unchanged against etcd or the in-memory store.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import fields, replace

from flowmaker.domain import Cluster, Model, Profile, ProfileSource
from flowmaker.state import keys
from flowmaker.state.records import ClusterView, read_cluster, reuse_load
from flowmaker.state.store import KeyValue, StateStore

log = logging.getLogger(__name__)

# Preference when the store holds several profiles of one (model, tp, pp): higher wins.
_SOURCE_RANK = {ProfileSource.ANALYTIC: 0, ProfileSource.MEASURED: 1}
_PROFILE_FIELDS = {f.name for f in fields(Profile)}
_CAMEL = re.compile(r"(?<=.)([A-Z])")


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


def with_loads(view: ClusterView, loads: dict[str, float]) -> ClusterView:
    """The view with each instance's load = the sum of its reuse mappings (0 when it has none)."""
    insts = {iid: replace(rec, load_output_tokens_per_s=loads.get(iid, 0.0)) for iid, rec in view.instances.items()}
    cluster = Cluster(view.cluster.gpus, tuple(insts[i.id].to_domain() for i in view.cluster.instances))
    return replace(view, cluster=cluster, instances=insts)


async def read_live_cluster(store: StateStore) -> ClusterView:
    """Alive GPUs and instances (with etags for the commit) and loads from the reuse mappings.

    The reuse keys are read after the instances: a commit that adds or drops a reuse mapping also
    rewrites the instance's record, so a mapping changed in between moves the instance's etag and
    aborts any commit based on this view."""
    view = await read_cluster(store)
    reuse = await store.get_prefix(keys.REUSE)
    return with_loads(view, loads_from_reuse(reuse.items))


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
