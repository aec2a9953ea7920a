"""The 7 evaluation tasks: valid candidate workflows, the token-shape rule, and the shapes the issue asks for."""

from __future__ import annotations

import pytest

from flowmaker.domain import StageKind
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.tasks import EVAL_TASKS, MAX_INPUT_TOKENS, get_task, nominal_workflows


def test_seven_tasks_three_valid_candidates_each() -> None:
    assert len(EVAL_TASKS) == 7
    assert len({t.name for t in EVAL_TASKS}) == 7
    for t in EVAL_TASKS:
        assert len(t.candidates) == 3, t.name
        assert len({c.id for c in t.candidates}) == 3
        t.slo().validate()
        for trace in ("code", "conv"):
            for w in t.nominal_workflows(trace):
                w.validate()
                assert 1 <= len(w.llm_stages) <= 3, (t.name, w.id)
                assert all(s.role and s.prompt_template for s in w.stages)


def test_alphas_spread_and_at_most_the_strong_models_accuracy() -> None:
    from flowmaker.catalog import default_models
    from flowmaker.eval.policies import ROUTELLM_STRONG
    strong = next(m for m in default_models() if m.id == ROUTELLM_STRONG).accuracy
    alphas = sorted(t.min_accuracy for t in EVAL_TASKS)
    assert alphas[0] <= 0.16 and alphas[-1] >= 0.40
    assert len(set(alphas)) == 7
    assert all(a <= strong for a in alphas)  # every baseline's strong model can meet every target


def test_fixed_workflows_are_declared_multi_stage_with_rationale_and_k_in_range() -> None:
    from flowmaker.eval.slo import SLO_K_RANGE
    stages = 0
    for t in EVAL_TASKS:
        assert t.fixed_workflow in {c.id for c in t.candidates}, t.name
        assert t.fixed_rationale and t.slo_k_rationale
        assert SLO_K_RANGE[0] <= t.slo_k <= SLO_K_RANGE[1]
        wf = t.fixed_nominal("conv")
        assert len(wf.llm_stages) >= 2, t.name  # the published fixed workflows have at least 2 stages
        stages += len(wf.llm_stages)
    assert stages == 15  # one LangChain instance per stage


def test_rule_slos_are_k_times_the_reference_standalone_latency() -> None:
    """Hand-computed: chat's fixed workflow (answer || moderation) on Qwen2.5-14B tp1, a lone median conv
    request: the slower parallel branch, fixed + prefill x in + decode x out."""
    from flowmaker.catalog import default_models, get_gpu_type
    from flowmaker.eval.slo import reference_profile, standalone_latency_s, with_rule_slos
    from flowmaker.profiling.analytic import profiles_for
    gpu, models = get_gpu_type("A6000"), default_models()
    profs = profiles_for(models, gpu, max_gpus=8)
    ref = reference_profile(profs)
    chat = get_task("chat")
    wf = chat.fixed_nominal("conv")
    want = max(ref.call_latency_s(s.input_tokens, s.output_tokens) for s in wf.llm_stages)
    by_id = {m.id: m for m in models}
    assert standalone_latency_s(chat, "conv", profs, by_id, gpu) == pytest.approx(want, rel=1e-9)
    ruled = {t.name: t for t in with_rule_slos(EVAL_TASKS, "conv", profs, by_id, gpu)}
    assert ruled["chat"].max_latency_s == pytest.approx(chat.slo_k * want, rel=1e-9)


def test_mix_of_shapes_tool_dag_and_multi_call() -> None:
    ws = [w for t in EVAL_TASKS for w in t.nominal_workflows()]
    assert any(any(s.kind is StageKind.TOOL for s in w.stages) for w in ws)
    assert any(any(s.calls_per_request > 1 for s in w.stages) for w in ws)
    # a parallel branch: two stages with the same dependencies
    assert any(len({s.depends_on for s in w.stages}) < len(w.stages) for w in ws)


def test_prompt_templates_only_name_input_and_upstream_stages() -> None:
    for t in EVAL_TASKS:
        for w in t.nominal_workflows():
            for s in w.stages:
                names = {"input", *s.depends_on}
                s.prompt_template.format(**{n: "x" for n in names})


def test_token_rule_follows_the_request_and_adds_upstream_outputs() -> None:
    t = get_task("summarize")
    small = t.workflow_for_request("sum-extract-abstract", 100, 10)
    big = t.workflow_for_request("sum-extract-abstract", 3000, 400)
    assert small.stage("extract").input_tokens == 100 + 40
    assert big.stage("extract").input_tokens == 3000 + 40
    assert big.stage("extract").output_tokens == round(0.4 * 400 + 40)
    # the abstract stage reads the extract's output
    assert big.stage("abstract").input_tokens == 40 + big.stage("extract").output_tokens


def test_token_rule_clamps_to_the_context_window() -> None:
    w = get_task("chat").workflow_for_request("chat-direct", 14050, 1000)
    assert w.stage("respond").input_tokens == MAX_INPUT_TOKENS
    w0 = get_task("chat").workflow_for_request("chat-direct", 0, 0)
    assert w0.stage("respond").output_tokens >= 1
    with pytest.raises(InvalidSpec):
        get_task("chat").workflow_for_request("chat-direct", -1, 3)


def test_nominal_uses_trace_medians() -> None:
    t = get_task("chat")
    assert t.nominal_tokens("conv") == (1020, 129)
    assert t.nominal_tokens("code") == (1469, 13)
    assert nominal_workflows("chat", "conv")[0].stage("respond").output_tokens == 129
    with pytest.raises(InvalidSpec, match="trace"):
        t.nominal_tokens("bogus")


def test_nominal_at_the_mean_for_capacity_planning() -> None:
    t = get_task("chat")
    assert t.nominal_tokens("conv", "mean") == (1155, 211)
    assert t.nominal_tokens("code", "mean") == (2048, 28)
    assert t.nominal_workflows("conv", "mean")[0].stage("respond").output_tokens == 211
    with pytest.raises(InvalidSpec, match="statistic"):
        t.nominal_tokens("conv", "p99")


def test_unknown_names_are_clear_errors() -> None:
    with pytest.raises(NotFound, match="known"):
        get_task("nope")
    with pytest.raises(NotFound, match="no workflow"):
        get_task("chat").workflow_for_request("nope", 1, 1)


def test_slo_scales_rate_with_load() -> None:
    t = get_task("code")
    assert t.slo(0.5).arrival_rate_rps == pytest.approx(t.nominal_rate_rps * 0.5)
    assert t.task_spec("code", 0.25).slo.arrival_rate_rps == pytest.approx(t.nominal_rate_rps * 0.25)
