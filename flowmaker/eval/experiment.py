"""The declared experiment of the evaluation: one TOML file fixes every setting before a run.

`load_experiment()` reads `flowmaker/eval/data/paper-scale.toml` (or a file the user names), checks it
(errors name the key) and keeps its SHA-256, which `bench serving` / `bench paper` print with every result:
a change to the file is a visibly new experiment. `Experiment.tasks_for` applies it to the evaluation tasks:
accuracy targets, SLO multipliers, latency SLOs of the declared reference deployment at the declared
request shape, and each task's 100%-load rate by the declared rate rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from flowmaker.domain import GpuType, Model, Profile
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.slo import SLO_K_RANGE, standalone_latency_s
from flowmaker.eval.tasks import EVAL_TASKS, EvalTask
from flowmaker.eval.trace_stats import TRACE_KINDS, TRACE_STATS

DEFAULT_EXPERIMENT = "paper-scale.toml"
QUANTILES = ("median", "mean", "p75", "p90", "p95", "p99")
RATE_RULES = ("routellm-max-quality-replicas",)
MURAKKAB_RATES = ("preceding-segment",)
MAX_GENERATED_SCALE = 16.0


@dataclass(frozen=True, slots=True)
class Experiment:
    """Every setting of one evaluation run, as declared in its file."""

    name: str
    source: str  # where it was read from
    sha256: str
    description: str
    gpu_type: str
    gpus: int
    loads: tuple[float, ...]
    segment_requests: int
    deploy_span_fraction: float
    monitor_window_fraction: float
    utilization_cap: float
    rate_rule: str
    routellm_max_quality_replicas: int
    weights: Mapping[str, float]
    reference_model: str
    reference_tp: int
    reference_quantile: str
    slo_k: Mapping[str, float]
    accuracy: Mapping[str, float]
    routellm_gpu_budget_gb: float
    murakkab_rate: str
    seeds: tuple[int, ...]
    # `[workload] generated_token_scale` (optional, default 1): every request's generated tokens x this
    # (EvalTask.generated_scale), in the plans, the SLO reference, the rate rule and the replay alike.
    generated_token_scale: float = 1.0
    # The sensitivity variants applied (`variant`), sorted, and the file's own name and hash they were applied to.
    variants: tuple[str, ...] = ()
    base_name: str = ""
    base_sha256: str = ""

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]

    def reference_tokens(self, kind: str) -> tuple[int, int]:
        """(context, generated) tokens of the SLO reference request on trace `kind`."""
        st = TRACE_STATS[kind]
        return round(getattr(st.context, self.reference_quantile)), round(getattr(st.generated, self.reference_quantile))

    def tasks_for(self, kind: str, profiles: Sequence[Profile], models: Mapping[str, Model], gpu_type: GpuType,
                  tasks: Sequence[EvalTask] = EVAL_TASKS) -> tuple[EvalTask, ...]:
        """The tasks as this experiment runs them on trace `kind`: accuracy targets, k, latency SLOs (k x the
        reference deployment's standalone latency at the reference request) and 100%-load rates."""
        ctx, gen = self.reference_tokens(kind)
        out = []
        for t in tasks:
            t2 = dataclasses.replace(t, min_accuracy=self.accuracy[t.name], slo_k=self.slo_k[t.name],
                                     generated_scale=self.generated_token_scale)
            lat = standalone_latency_s(t2, kind, profiles, models, gpu_type, tokens=(ctx, gen),
                                       reference=(self.reference_model, self.reference_tp))
            out.append(dataclasses.replace(t2, max_latency_s=t2.slo_k * lat))
        total = self.full_load_rate(kind, out, profiles)
        wsum = sum(self.weights[t.name] for t in out)
        return tuple(dataclasses.replace(t, nominal_rate_rps=total * self.weights[t.name] / wsum) for t in out)

    def full_load_rate(self, kind: str, tasks: Sequence[EvalTask], profiles: Sequence[Profile]) -> float:
        """The 100%-load total rate (req/s) of the rate rule: RouteLLM max-quality, every request on
        Qwen2.5-14B-Instruct tp1, sized by busy time at the trace's mean request under the cap, needs exactly
        `routellm_max_quality_replicas` replicas."""
        from flowmaker.eval.policies import ROUTELLM_SIZE_STAT, ROUTELLM_STRONG, busy_seconds

        prof = next((p for p in profiles if p.model_id == ROUTELLM_STRONG and (p.tp, p.pp) == (1, 1)), None)
        if prof is None:
            raise InvalidSpec(f"no {ROUTELLM_STRONG} tp1 profile for the rate rule", field="rate.rule")
        wsum = sum(self.weights[t.name] for t in tasks)
        per_req = sum(self.weights[t.name] / wsum * busy_seconds(prof, t.fixed_nominal(kind, ROUTELLM_SIZE_STAT))
                      for t in tasks)
        # A hair under the replica count, so that ceil(need / cap) is exactly that count despite rounding.
        return self.routellm_max_quality_replicas * self.utilization_cap * (1 - 1e-9) / per_req

    def as_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: (dict(v) if isinstance(v, Mapping) else list(v) if isinstance(v, tuple) else v)
                for k, v in d.items()}


def _get(d: Mapping[str, Any], path: str) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise InvalidSpec("missing", field=f"experiment.{path}")
        cur = cur[part]
    return cur


def _num(d: Mapping[str, Any], path: str, lo: float, hi: float, *, integer: bool = False) -> float:
    v = _get(d, path)
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
        raise InvalidSpec(f"must be {'an integer' if integer else 'a number'}, got {v!r}", field=f"experiment.{path}")
    if not (lo <= v <= hi) or not math.isfinite(v):
        raise InvalidSpec(f"must be within [{lo:g}, {hi:g}], got {v!r}", field=f"experiment.{path}")
    return float(v)


def _choice(d: Mapping[str, Any], path: str, allowed: Sequence[str]) -> str:
    v = _get(d, path)
    if v not in allowed:
        raise InvalidSpec(f"must be one of {list(allowed)}, got {v!r}", field=f"experiment.{path}")
    return str(v)


def _per_task(d: Mapping[str, Any], path: str, lo: float, hi: float) -> dict[str, float]:
    m = _get(d, path)
    names = [t.name for t in EVAL_TASKS]
    if not isinstance(m, Mapping) or sorted(m) != sorted(names):
        got = sorted(m) if isinstance(m, Mapping) else m
        raise InvalidSpec(f"must name exactly the tasks {names}, got {got}", field=f"experiment.{path}")
    return {n: _num(d, f"{path}.{n}", lo, hi) for n in names}


def parse_experiment(text: str, source: str) -> Experiment:
    """Check and read one experiment file's text; errors name the key (`experiment.<key>`)."""
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidSpec(f"{source}: not valid TOML: {e}", field="experiment") from None
    loads = _get(d, "workload.loads")
    if not isinstance(loads, list) or not loads or any(
            isinstance(x, bool) or not isinstance(x, int | float) or not 0 < x <= 4 for x in loads):
        raise InvalidSpec(f"must be a non-empty list of numbers in (0, 4], got {loads!r}",
                          field="experiment.workload.loads")
    seeds = _get(d, "seeds.spread")
    if not isinstance(seeds, list) or not seeds or any(isinstance(x, bool) or not isinstance(x, int) for x in seeds):
        raise InvalidSpec(f"must be a non-empty list of integers, got {seeds!r}", field="experiment.seeds.spread")
    k = _per_task(d, "slo.k", *SLO_K_RANGE)
    gpu = str(_get(d, "cluster.gpu_type"))
    return Experiment(
        name=str(_get(d, "name")), source=source, sha256=hashlib.sha256(text.encode()).hexdigest(),
        description=str(d.get("description", "")), gpu_type=gpu,
        gpus=int(_num(d, "cluster.gpus", 1, 64, integer=True)),
        loads=tuple(float(x) for x in loads),
        segment_requests=int(_num(d, "workload.segment_requests", 20, 100_000, integer=True)),
        deploy_span_fraction=_num(d, "workload.deploy_span_fraction", 0.0, 0.9),
        monitor_window_fraction=_num(d, "workload.monitor_window_fraction", 0.01, 0.5),
        utilization_cap=_num(d, "workload.utilization_cap", 0.05, 1.0),
        rate_rule=_choice(d, "rate.rule", RATE_RULES),
        routellm_max_quality_replicas=int(_num(d, "rate.routellm_max_quality_replicas", 1, 64, integer=True)),
        weights=_per_task(d, "rate.weights", 1e-6, 1e6),
        reference_model=str(_get(d, "slo.reference_model")),
        reference_tp=int(_num(d, "slo.reference_tp", 1, 8, integer=True)),
        reference_quantile=_choice(d, "slo.reference_quantile", QUANTILES),
        slo_k=k, accuracy=_per_task(d, "accuracy.targets", 0.0, 1.0),
        routellm_gpu_budget_gb=_num(d, "baselines.routellm_gpu_budget_gb", 0.0, 1e6),
        murakkab_rate=_choice(d, "baselines.murakkab_rate", MURAKKAB_RATES),
        seeds=tuple(int(x) for x in seeds),
        generated_token_scale=(_num(d, "workload.generated_token_scale", 0.05, MAX_GENERATED_SCALE)
                               if "generated_token_scale" in d.get("workload", {}) else 1.0),
    )


# The published evaluation's latency scale: its variants answer in 0.6-119 s and its loosest SLO is 510 s. Our
# requests are the Azure traces' (conv median 129 generated tokens, code 13): the declared reference answers in
# 4.7-50 s, with SLOs up to 200 s. Generated tokens x 4 puts it at 7.8-111 s and the loosest SLO at 508 s (conv,
# math: 5 x 101.5 s); x 3 gives 443 s, x 5 549 s (outputs clamp at 1,024 tokens, so the longest reference stays at
# 111 s from x 3 on). The rate rule lowers the rates to match, so the cluster's load per level is unchanged.
PUBLISHED_LATENCY_GENERATED_SCALE = 4.0


# name -> the tag it adds to the experiment's name
VARIANTS = {"product-targets": "product-targets",
            "published-latency-scale": f"generated-x{PUBLISHED_LATENCY_GENERATED_SCALE:g}"}


def variant(exp: Experiment, kind: str) -> Experiment:
    """A sensitivity variant of a declared experiment: "product-targets" (the tasks' own accuracy targets,
    flowmaker/eval/tasks.py, instead of the declared ones); "published-latency-scale" (every request's generated
    tokens x PUBLISHED_LATENCY_GENERATED_SCALE). Its name and hash depend on the file and the SET of variants
    applied, not on their order; applying one twice changes nothing."""
    if kind not in VARIANTS:
        raise InvalidSpec(f"unknown variant {kind!r}; known: {list(VARIANTS)}", field="variant")
    if kind in exp.variants:
        return exp
    applied = tuple(sorted((*exp.variants, kind)))
    base_sha, base_name = exp.base_sha256 or exp.sha256, exp.base_name or exp.name
    if kind == "product-targets":
        exp = dataclasses.replace(exp, accuracy={t.name: t.min_accuracy for t in EVAL_TASKS})
    else:
        exp = dataclasses.replace(exp, generated_token_scale=PUBLISHED_LATENCY_GENERATED_SCALE)
    return dataclasses.replace(exp, variants=applied, base_sha256=base_sha, base_name=base_name,
                               name=base_name + "".join(f"+{VARIANTS[v]}" for v in applied),
                               sha256=hashlib.sha256(f"{base_sha}/variants={','.join(applied)}".encode()).hexdigest())


def load_experiment(path: str | Path | None = None) -> Experiment:
    """The experiment in `path`, or the shipped default (`paper-scale.toml`)."""
    if path is None:
        text = resources.files("flowmaker.eval").joinpath("data", DEFAULT_EXPERIMENT).read_text()
        return parse_experiment(text, f"flowmaker/eval/data/{DEFAULT_EXPERIMENT}")
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"no experiment file {str(p)!r}", field="experiment")
    return parse_experiment(p.read_text(), str(p))


__all__ = ["DEFAULT_EXPERIMENT", "PUBLISHED_LATENCY_GENERATED_SCALE", "TRACE_KINDS", "VARIANTS", "Experiment",
           "load_experiment", "parse_experiment", "variant"]
