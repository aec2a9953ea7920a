"""Workflows: a DAG of LLM and TOOL stages, validated once at construction time by `validate()`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flowmaker.errors import InvalidSpec


class StageKind(enum.Enum):
    """What runs in a stage."""

    LLM = "LLM"  # a call to a model instance; needs an instance in the variant
    TOOL = "TOOL"  # a non-LLM step (retrieval, code execution); takes latency_s, no GPU


@dataclass(frozen=True, slots=True)
class Stage:
    """One step of a workflow. Token counts are per call; `calls_per_request`
    multiplies both latency and load (e.g. a self-consistency stage sampling 3 times)."""

    id: str
    kind: StageKind = StageKind.LLM
    depends_on: tuple[str, ...] = ()
    input_tokens: int = 0
    output_tokens: int = 0
    calls_per_request: int = 1
    latency_s: float = 0.0  # TOOL stages only
    role: str = ""  # e.g. "summarizer"; shown to the user
    prompt_template: str = ""  # str.format template: {input} and {<upstream stage id>}

    @property
    def is_llm(self) -> bool:
        return self.kind is StageKind.LLM


@dataclass(frozen=True, slots=True)
class Workflow:
    """A candidate workflow. `stages` are in the user's list order, which the
    selection spec uses for its topological-order tie-break."""

    id: str
    stages: tuple[Stage, ...]
    description: str = ""
    rationale: str = ""  # one line the user sees when approving

    def validate(self, path: str = "workflow") -> Workflow:
        """Raise InvalidSpec naming the stage and field of the first violation; return self."""
        if not self.id:
            raise InvalidSpec("must not be empty", field=f"{path}.id")
        if not self.stages:
            raise InvalidSpec("a workflow needs at least one stage", field=f"{path}.stages")
        seen: set[str] = set()
        for i, st in enumerate(self.stages):
            sp = f"{path}.stages[{i}]"
            if not st.id:
                raise InvalidSpec("must not be empty", field=f"{sp}.id")
            if st.id in seen:
                raise InvalidSpec(f"duplicate stage id {st.id!r}", field=f"{sp}.id")
            seen.add(st.id)
            if st.calls_per_request < 1:
                raise InvalidSpec(f"stage {st.id!r}: must be >= 1, got {st.calls_per_request}",
                                  field=f"{sp}.calls_per_request")
            if st.kind is StageKind.LLM:
                if st.input_tokens <= 0:
                    raise InvalidSpec(f"stage {st.id!r}: must be > 0, got {st.input_tokens}",
                                      field=f"{sp}.input_tokens")
                if st.output_tokens <= 0:
                    raise InvalidSpec(f"stage {st.id!r}: must be > 0, got {st.output_tokens}",
                                      field=f"{sp}.output_tokens")
            elif st.kind is StageKind.TOOL:
                if not st.latency_s >= 0.0:  # also rejects NaN
                    raise InvalidSpec(f"stage {st.id!r}: must be >= 0, got {st.latency_s}",
                                      field=f"{sp}.latency_s")
            else:  # pragma: no cover - enum exhausted
                raise InvalidSpec(f"stage {st.id!r}: unknown kind", field=f"{sp}.kind")
        ids = {s.id for s in self.stages}
        for i, st in enumerate(self.stages):
            for d in st.depends_on:
                if d not in ids:
                    raise InvalidSpec(f"stage {st.id!r} depends on unknown stage {d!r}",
                                      field=f"{path}.stages[{i}].depends_on")
                if d == st.id:
                    raise InvalidSpec(f"stage {st.id!r} depends on itself",
                                      field=f"{path}.stages[{i}].depends_on")
        if len(self.topo_order()) != len(self.stages):
            cyc = sorted(ids - {self.stages[i].id for i in self.topo_order()})
            raise InvalidSpec(f"dependencies form a cycle through stages {cyc}",
                              field=f"{path}.stages")
        if not any(s.is_llm for s in self.stages):
            raise InvalidSpec("a workflow needs at least one LLM stage", field=f"{path}.stages")
        return self

    def topo_order(self) -> tuple[int, ...]:
        """Stage indices in the spec's order: repeatedly take the first stage, in
        list order, whose dependencies have all been taken. On a cycle the
        result is shorter than `stages` (validate() reports it)."""
        taken: set[str] = set()
        order: list[int] = []
        remaining = list(range(len(self.stages)))
        while remaining:
            for pos, i in enumerate(remaining):
                if all(d in taken for d in self.stages[i].depends_on):
                    order.append(i)
                    taken.add(self.stages[i].id)
                    del remaining[pos]
                    break
            else:
                break
        return tuple(order)

    @property
    def llm_stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.is_llm)

    def stage(self, stage_id: str) -> Stage:
        for s in self.stages:
            if s.id == stage_id:
                return s
        raise KeyError(stage_id)


@dataclass(frozen=True, slots=True)
class Slo:
    """The user's targets for a task."""

    min_accuracy: float  # alpha, 0..1
    max_latency_s: float  # lambda, > 0, end-to-end per request
    arrival_rate_rps: float = 0.0  # rho, >= 0, requests per second

    def validate(self, path: str = "slo") -> Slo:
        if not 0.0 <= self.min_accuracy <= 1.0:
            raise InvalidSpec(f"must be within [0, 1] (a fraction, not a percentage), got {self.min_accuracy}",
                              field=f"{path}.min_accuracy")
        if not self.max_latency_s > 0.0:
            raise InvalidSpec(f"must be > 0, got {self.max_latency_s}", field=f"{path}.max_latency_s")
        if not self.arrival_rate_rps >= 0.0 or self.arrival_rate_rps == float("inf"):
            raise InvalidSpec(f"must be a finite number >= 0, got {self.arrival_rate_rps}",
                              field=f"{path}.arrival_rate_rps")
        return self


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """What a user asks the orchestrator for."""

    description: str
    slo: Slo
    name: str = ""
    candidates: tuple[Workflow, ...] = field(default_factory=tuple)
