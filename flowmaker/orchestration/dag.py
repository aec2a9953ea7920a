"""Running one request through a workflow DAG: prompt filling and the parallel stage schedule (pure asyncio, no I/O).

Each stage starts as soon as every stage it depends on has finished, so independent stages run in
parallel. The caller supplies `run_stage(stage, prompt)`, which does the I/O (an LLM call to the
stage's instance, or the emulated TOOL step). The first failing stage cancels the others and its
error propagates.

Prompt filling: a stage's `prompt_template` is a `str.format` template over `{input}` (the request's
input) and `{<stage id>}` (the output text of an upstream stage). A placeholder naming no known value
is left as written; an empty template means "the input followed by the upstream outputs".
"""

from __future__ import annotations

import asyncio
import string
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from flowmaker.domain import Stage, Workflow


@dataclass(frozen=True, slots=True)
class StageResult:
    """What one stage produced; `start_s` is the offset from the request's start."""

    stage_id: str
    output: str
    instance_id: str = ""
    model_id: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    start_s: float = 0.0
    latency_s: float = 0.0
    finish_reason: str = ""  # the engine's, of the stage's last LLM call ("stop", "length"); "" for TOOL stages


@dataclass(frozen=True, slots=True)
class Execution:
    output: str  # the final stage's output
    latency_s: float
    stages: tuple[StageResult, ...]  # in completion order


class _Keep(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def fill_prompt(stage: Stage, request_input: str, outputs: Mapping[str, str]) -> str:
    """The stage's prompt: its template filled from the request input and its upstream outputs."""
    if not stage.prompt_template.strip():
        parts = [request_input, *(outputs[d] for d in stage.depends_on if d in outputs)]
        return "\n\n".join(p for p in parts if p)
    values = _Keep({d: outputs[d] for d in stage.depends_on if d in outputs})
    values["input"] = request_input
    try:
        return string.Formatter().vformat(stage.prompt_template, (), values)
    except (ValueError, IndexError, KeyError, AttributeError):
        # A template that is not valid str.format (stray braces, positional fields): substitute the
        # names we know literally rather than fail the request.
        text = stage.prompt_template
        for k, v in values.items():
            text = text.replace("{" + k + "}", v)
        return text


def final_stage(workflow: Workflow) -> Stage:
    """The stage whose output answers the request: the last stage, in the spec's topological order,
    that no other stage depends on."""
    used = {d for s in workflow.stages for d in s.depends_on}
    order = [workflow.stages[i] for i in workflow.topo_order()]
    sinks = [s for s in order if s.id not in used]
    return (sinks or order)[-1]


RunStage = Callable[[Stage, str], Awaitable[StageResult]]
OnStageDone = Callable[[StageResult], Awaitable[None] | None]


async def execute(workflow: Workflow, request_input: str, run_stage: RunStage,
                  on_stage_done: OnStageDone | None = None) -> Execution:
    """Run every stage once its dependencies are done; return the final output and per-stage results."""
    t0 = time.monotonic()
    done: dict[str, asyncio.Future[StageResult]] = {
        s.id: asyncio.get_running_loop().create_future() for s in workflow.stages}
    finished: list[StageResult] = []
    outputs: dict[str, str] = {}

    async def one(stage: Stage) -> None:
        for d in stage.depends_on:
            await done[d]
        prompt = fill_prompt(stage, request_input, outputs)
        start = time.monotonic() - t0
        res = await run_stage(stage, prompt)
        res = StageResult(res.stage_id or stage.id, res.output, res.instance_id, res.model_id, res.input_tokens,
                          res.output_tokens, start, res.latency_s or (time.monotonic() - t0 - start),
                          res.finish_reason)
        outputs[stage.id] = res.output
        finished.append(res)
        if on_stage_done is not None:
            r = on_stage_done(res)
            if r is not None:
                await r
        done[stage.id].set_result(res)

    tasks = [asyncio.create_task(one(s), name=f"stage-{s.id}") for s in workflow.stages]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for f in done.values():
            if not f.done():
                f.cancel()
    last = final_stage(workflow)
    return Execution(outputs[last.id], time.monotonic() - t0, tuple(finished))
