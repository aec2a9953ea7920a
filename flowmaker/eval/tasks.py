"""The 7 evaluation tasks: SLOs, nominal rates and 3 candidate workflows each, with per-request token shapes.

Why these tasks: they are the generative-AI workloads that multi-step LLM
serving papers evaluate on (code generation, math word problems, summarisation,
multi-hop QA, chat, translation, extraction), and together they cover every
shape the selector must handle: single calls, chains, TOOL stages, DAGs with
parallel branches, and stages sampled several times (`calls_per_request > 1`).

Accuracy SLOs (alpha) are spread over 0.15..0.44 so that different tasks need
different model sizes with the default catalog (Open LLM Leaderboard v2
averages 0.14..0.48): extraction is met by a 1B model, multi-hop QA only by
~32B+ models. Latency SLOs are end-to-end per request, set from what a user of
each task would tolerate (interactive completion and extraction: seconds;
reasoning tasks: tens of seconds), not tuned to any policy.

Token shapes. Every request of a trace carries (context, generated) tokens. A
stage's tokens are derived from them by a fixed linear rule (`StageShape`):

    input  = clamp(in_ctx * context + in_gen * generated + in_fixed + sum(outputs of upstream stages), 1, max_in)
    output = clamp(out_gen * generated + out_fixed, 1, max_out)

`in_fixed`/`out_fixed` are instruction/template overheads; upstream outputs are
added when the stage consumes them (`in_upstream`; TOOL stages "output" the
tokens they return, e.g. retrieved passages). `max_in` keeps prompts inside the
smallest context window of the catalog (8k, gemma-2). The *nominal* workflow
of a task is the same rule at a trace's median (context, generated); the
selector plans with it, the simulator serves each request with its own shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowmaker.domain import Slo, Stage, StageKind, TaskSpec, Workflow
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.trace_stats import TRACE_KINDS, TRACE_STATS

MAX_INPUT_TOKENS = 7000  # the catalog's smallest context window is 8192 (gemma-2); leave room for output
MAX_OUTPUT_TOKENS = 1024
NOMINAL_STATS = ("median", "mean")

# Nominal (100% load) arrival rate of a task: half the recorded mean rate of its home Azure trace
# (conv 5.53, code 2.567 req/s), 16.4 req/s over the 7 tasks. At the full recorded rate (32.8 req/s)
# even the cheapest plans no longer fit 8xA6000 on the conversation trace; at half of it the cluster is
# near saturation at 100% and lightly used at 25%, which is the range the load levels should span.
NOMINAL_RATE_FRACTION = 0.5
CONV_RATE = NOMINAL_RATE_FRACTION * TRACE_STATS["conv"].mean_rate_rps  # 2.765 req/s
CODE_RATE = NOMINAL_RATE_FRACTION * TRACE_STATS["code"].mean_rate_rps  # 1.28 req/s

LLM = StageKind.LLM
TOOL = StageKind.TOOL


@dataclass(frozen=True, slots=True)
class StageShape:
    """One stage of a candidate workflow, with the rule that sizes it from a request's trace tokens."""

    id: str
    role: str
    prompt_template: str  # str.format: {input} and {<upstream stage id>}
    kind: StageKind = LLM
    depends_on: tuple[str, ...] = ()
    calls_per_request: int = 1
    latency_s: float = 0.0  # TOOL stages
    in_ctx: float = 0.0  # x the request's context tokens
    in_gen: float = 0.0  # x the request's generated tokens (e.g. a translation's source is as long as its target)
    in_fixed: int = 0  # instructions, schema, few-shot examples
    in_upstream: bool = True  # add the output tokens of every stage this one depends on
    out_gen: float = 0.0  # x the request's generated tokens
    out_fixed: int = 0
    max_in: int = MAX_INPUT_TOKENS
    max_out: int = MAX_OUTPUT_TOKENS

    def tokens(self, context: int, generated: int, upstream_out: int) -> tuple[int, int]:
        """(input, output) tokens of one call of this stage for one request."""
        tin = self.in_ctx * context + self.in_gen * generated + self.in_fixed
        if self.in_upstream:
            tin += upstream_out
        tout = self.out_gen * generated + self.out_fixed
        return (min(max(round(tin), 1), self.max_in), min(max(round(tout), 1), self.max_out))


@dataclass(frozen=True, slots=True)
class CandidateWorkflow:
    """A candidate workflow of a task, before it is sized for a request."""

    id: str
    description: str
    rationale: str
    stages: tuple[StageShape, ...]

    def instantiate(self, context: int, generated: int) -> Workflow:
        """The workflow with every stage's tokens derived from (context, generated); see the module doc."""
        if context < 0 or generated < 0:
            raise InvalidSpec(f"token counts must be >= 0, got context={context} generated={generated}",
                              field="request.tokens")
        outs: dict[str, int] = {}
        stages: list[Stage] = []
        for s in self.stages:  # stages are listed in a topological order
            up = sum(outs[d] for d in s.depends_on)
            tin, tout = s.tokens(context, generated, up)
            outs[s.id] = tout
            stages.append(Stage(id=s.id, kind=s.kind, depends_on=s.depends_on, input_tokens=tin,
                                output_tokens=tout, calls_per_request=s.calls_per_request,
                                latency_s=s.latency_s, role=s.role, prompt_template=s.prompt_template))
        return Workflow(id=self.id, stages=tuple(stages), description=self.description, rationale=self.rationale)


@dataclass(frozen=True, slots=True)
class EvalTask:
    """One evaluation task: what it is, its SLOs, its nominal rate, and its 3 candidate workflows."""

    name: str
    title: str
    description: str
    min_accuracy: float  # alpha
    max_latency_s: float  # lambda, end-to-end per request
    nominal_rate_rps: float  # arrival rate at 100% load
    home_trace: str  # the Azure trace whose token shapes fit the task best (used when no trace is given)
    candidates: tuple[CandidateWorkflow, ...]
    why: str = ""  # why these SLOs
    # The one workflow a developer using LangChain would write for this task, fixed before any run; the
    # baselines (LangChain, RouteLLM, Murakkab) serve it. FlowMaker chooses among all candidates.
    fixed_workflow: str = ""
    fixed_rationale: str = ""
    # Latency SLO by rule (docs/evaluation.md): slo_k x the simulated standalone latency of the reference
    # deployment (`flowmaker.eval.slo`), k in [2, 5], fixed per task before any run.
    slo_k: float = 3.0
    slo_k_rationale: str = ""
    # Every request's generated tokens are taken as this many times the trace's (a sensitivity of the declared
    # experiment: requests as long as the published task datasets'; docs/evaluation.md). 1: the trace as recorded.
    generated_scale: float = 1.0

    def slo(self, load: float = 1.0) -> Slo:
        """The SLO at a load level (fraction of the nominal rate)."""
        if not load >= 0:
            raise InvalidSpec(f"must be >= 0, got {load}", field="load")
        return Slo(min_accuracy=self.min_accuracy, max_latency_s=self.max_latency_s,
                   arrival_rate_rps=self.nominal_rate_rps * load)

    @property
    def fixed(self) -> CandidateWorkflow:
        """The fixed (LangChain-style) workflow the baselines serve."""
        return self.candidate(self.fixed_workflow or self.candidates[0].id)

    def fixed_nominal(self, trace: str | None = None, stat: str = "median") -> Workflow:
        ctx, gen = self.nominal_tokens(trace, stat)
        return self.sized(self.fixed, ctx, gen)

    def sized(self, candidate: CandidateWorkflow, context_tokens: int, generated_tokens: int) -> Workflow:
        """`candidate` sized for a trace request of (context, generated) tokens, the generated ones scaled by
        `generated_scale`: every place a trace request becomes a workflow goes through here."""
        gen = generated_tokens if self.generated_scale == 1.0 else round(generated_tokens * self.generated_scale)
        return candidate.instantiate(context_tokens, gen)

    def candidate(self, workflow_id: str) -> CandidateWorkflow:
        for c in self.candidates:
            if c.id == workflow_id:
                return c
        raise NotFound(f"task {self.name!r} has no workflow {workflow_id!r}; known: {[c.id for c in self.candidates]}",
                       field="workflow_id")

    def workflow_for_request(self, workflow_id: str, context_tokens: int, generated_tokens: int) -> Workflow:
        """The candidate `workflow_id` sized for one trace request (see the module doc for the rule)."""
        return self.sized(self.candidate(workflow_id), context_tokens, generated_tokens)

    def nominal_tokens(self, trace: str | None = None, stat: str = "median") -> tuple[int, int]:
        """(context, generated) tokens of `trace` ("code"/"conv"; default: the task's home trace) at `stat`:
        "median" (a typical request) or "mean" (rate x mean tokens is the true token rate: capacity planning)."""
        kind = trace or self.home_trace
        if kind not in TRACE_STATS:
            raise InvalidSpec(f"unknown trace kind {kind!r}; known: {list(TRACE_KINDS)}", field="trace")
        if stat not in NOMINAL_STATS:
            raise InvalidSpec(f"unknown statistic {stat!r}; known: {list(NOMINAL_STATS)}", field="stat")
        st = TRACE_STATS[kind]
        return round(getattr(st.context, stat)), round(getattr(st.generated, stat))

    def nominal_workflows(self, trace: str | None = None, stat: str = "median") -> tuple[Workflow, ...]:
        """The 3 candidates sized at the trace's median (or mean) request: what the selector plans with."""
        ctx, gen = self.nominal_tokens(trace, stat)
        return tuple(self.sized(c, ctx, gen) for c in self.candidates)

    def task_spec(self, trace: str | None = None, load: float = 1.0) -> TaskSpec:
        return TaskSpec(description=self.description, slo=self.slo(load), name=self.name,
                        candidates=self.nominal_workflows(trace))


def _llm(id: str, role: str, prompt: str, **kw: object) -> StageShape:
    return StageShape(id=id, role=role, prompt_template=prompt, kind=LLM, **kw)  # type: ignore[arg-type]


def _tool(id: str, role: str, what: str, latency_s: float, out_fixed: int, depends_on: tuple[str, ...] = ()) -> StageShape:
    # A TOOL stage's "output tokens" are what it returns into downstream prompts (passages, test logs).
    return StageShape(id=id, role=role, prompt_template=what, kind=TOOL, latency_s=latency_s,
                      depends_on=depends_on, in_upstream=False, out_fixed=out_fixed)


CHAT = EvalTask(
    name="chat", title="Assistant chat",
    description="Answer a user's message in a multi-turn assistant conversation, helpfully and safely.",
    min_accuracy=0.25, max_latency_s=12.0, nominal_rate_rps=CONV_RATE, home_trace="conv",
    why="General chat tolerates mid-size models (alpha 0.25); a reply should finish within ~12 s.",
    fixed_workflow="chat-guarded", fixed_rationale="A LangChain chat app adds a moderation chain beside the "
    "answer (RunnableParallel): the guardrail most production chat apps are required to have.",
    slo_k=3.0, slo_k_rationale="Interactive: a user waits for the reply, so little slack (3x).",
    candidates=(
        CandidateWorkflow(
            "chat-direct", "One call answers the conversation.",
            "Cheapest and fastest; enough when the model is already aligned.",
            (_llm("respond", "assistant", "Conversation so far:\n{input}\nReply as the assistant.",
                  in_ctx=1.0, in_fixed=40, out_gen=1.0),)),
        CandidateWorkflow(
            "chat-guarded", "Answer and a moderation check run in parallel; the answer is withheld if flagged.",
            "Adds a safety check without adding latency (parallel branch).",
            (_llm("respond", "assistant", "Conversation so far:\n{input}\nReply as the assistant.",
                  in_ctx=1.0, in_fixed=40, out_gen=1.0),
             _llm("moderate", "moderator", "Is the following conversation safe to answer? Reply SAFE or UNSAFE "
                  "with a category.\n{input}", in_ctx=1.0, in_fixed=80, out_fixed=8))),
        CandidateWorkflow(
            "chat-refine", "Draft an answer, then refine it for correctness and tone.",
            "Draft-then-refine raises quality for hard questions at the price of a second call.",
            (_llm("draft", "assistant", "Conversation so far:\n{input}\nDraft a reply.",
                  in_ctx=1.0, in_fixed=40, out_gen=1.0),
             _llm("refine", "editor", "Conversation (last turns):\n{input}\nDraft reply:\n{draft}\n"
                  "Fix mistakes and improve clarity; output the final reply.",
                  depends_on=("draft",), in_ctx=0.25, in_fixed=60, out_gen=1.0))),
    ),
)

CODE = EvalTask(
    name="code", title="Code generation",
    description="Complete or generate code in an IDE from the surrounding file context.",
    min_accuracy=0.35, max_latency_s=8.0, nominal_rate_rps=CODE_RATE, home_trace="code",
    why="Code needs a strong model (alpha 0.35, Qwen2.5-7B class or better); IDE users wait a few seconds at most.",
    fixed_workflow="code-test-fix", fixed_rationale="Generate, run the tests, repair: the standard LangChain/"
    "LangGraph code-assistant loop (one repair round).",
    slo_k=2.0, slo_k_rationale="IDE assistance: the tightest slack (2x).",
    candidates=(
        CandidateWorkflow(
            "code-direct", "One call completes the code.",
            "Lowest latency, as IDE completion needs.",
            (_llm("complete", "coder", "Complete the code at <CURSOR>.\n{input}", in_ctx=1.0, in_fixed=50,
                  out_gen=1.0),)),
        CandidateWorkflow(
            "code-test-fix", "Generate, run the unit tests, then fix the code using the test log.",
            "Executing tests catches wrong completions; the fix stage sees the failures.",
            (_llm("generate", "coder", "Complete the code at <CURSOR>.\n{input}", in_ctx=1.0, in_fixed=50,
                  out_gen=1.0),
             _tool("run_tests", "test runner", "pytest on the candidate completion", 0.8, 120, ("generate",)),
             _llm("fix", "reviewer", "Code:\n{input}\nCandidate:\n{generate}\nTest log:\n{run_tests}\n"
                  "Return the corrected completion.", depends_on=("generate", "run_tests"), in_ctx=0.5,
                  in_fixed=60, out_gen=1.0))),
        CandidateWorkflow(
            "code-sample-rank", "Sample 3 completions, keep the one that passes the tests.",
            "Best-of-n sampling with execution feedback (3 calls of one stage).",
            (_llm("sample", "coder", "Complete the code at <CURSOR>.\n{input}", in_ctx=1.0, in_fixed=50,
                  out_gen=1.0, calls_per_request=3),
             _tool("rank", "test runner", "run the tests on each sample and keep the first that passes", 0.5, 0,
                   ("sample",)))),
    ),
)

MATH = EvalTask(
    name="math", title="Math word problems",
    description="Solve a grade-school math word problem and state the final number.",
    min_accuracy=0.40, max_latency_s=30.0, nominal_rate_rps=CONV_RATE, home_trace="conv",
    why="Multi-step arithmetic reasoning needs ~14B+ models (alpha 0.40); users accept tens of seconds.",
    fixed_workflow="math-program", fixed_rationale="LangChain's program-aided (PAL) math chain: write Python, "
    "execute it, explain the result.",
    slo_k=5.0, slo_k_rationale="Offline-style reasoning: users accept waiting (5x).",
    candidates=(
        CandidateWorkflow(
            "math-cot", "Chain-of-thought solution in one call.",
            "One reasoning pass; cheapest.",
            (_llm("solve", "solver", "Solve step by step, then give 'Answer: <number>'.\n{input}",
                  in_ctx=0.25, in_fixed=300, out_gen=1.5, out_fixed=60),)),
        CandidateWorkflow(
            "math-self-consistency", "Sample 3 chains of thought and take the majority answer.",
            "Self-consistency: majority voting over samples is more reliable than one chain.",
            (_llm("solve", "solver", "Solve step by step, then give 'Answer: <number>'.\n{input}",
                  in_ctx=0.25, in_fixed=300, out_gen=1.5, out_fixed=60, calls_per_request=3),
             _tool("vote", "voter", "majority vote over the 3 answers", 0.01, 8, ("solve",)))),
        CandidateWorkflow(
            "math-program", "Write a Python program, execute it, then explain the result.",
            "Program-of-thought: arithmetic is done by the interpreter, not the model.",
            (_llm("program", "programmer", "Write a Python function solve() that returns the answer.\n{input}",
                  in_ctx=0.25, in_fixed=200, out_gen=0.75, out_fixed=40),
             _tool("execute", "python sandbox", "run solve() in a sandbox", 0.3, 20, ("program",)),
             _llm("explain", "explainer", "Problem:\n{input}\nProgram:\n{program}\nResult: {execute}\n"
                  "Explain the solution briefly and give 'Answer: <number>'.",
                  depends_on=("program", "execute"), in_ctx=0.25, in_fixed=60, out_gen=0.5, out_fixed=20))),
    ),
)

SUMMARIZE = EvalTask(
    name="summarize", title="Summarisation",
    description="Summarise a document (meeting notes, an article, a report) in a few paragraphs.",
    min_accuracy=0.20, max_latency_s=15.0, nominal_rate_rps=CONV_RATE, home_trace="conv",
    why="Summaries are forgiving (alpha 0.20, small models do well); a summary within ~15 s.",
    fixed_workflow="sum-map-reduce", fixed_rationale="LangChain's map-reduce summarize chain, its documented "
    "default for documents of arbitrary length.",
    slo_k=4.0, slo_k_rationale="A document summary is read after a short wait (4x).",
    candidates=(
        CandidateWorkflow(
            "sum-direct", "Summarise the whole document in one call.",
            "One pass when the document fits in the context window.",
            (_llm("summarize", "summarizer", "Summarise the document:\n{input}", in_ctx=1.0, in_fixed=40,
                  out_gen=0.5, out_fixed=32),)),
        CandidateWorkflow(
            "sum-map-reduce", "Summarise the two halves in parallel, then merge the partial summaries.",
            "Map-reduce keeps each prompt short and parallelises long documents.",
            (_llm("chunk_a", "summarizer", "Summarise this first half:\n{input}", in_ctx=0.5, in_fixed=40,
                  out_gen=0.3, out_fixed=24),
             _llm("chunk_b", "summarizer", "Summarise this second half:\n{input}", in_ctx=0.5, in_fixed=40,
                  out_gen=0.3, out_fixed=24),
             _llm("reduce", "editor", "Merge these partial summaries into one:\n{chunk_a}\n{chunk_b}",
                  depends_on=("chunk_a", "chunk_b"), in_fixed=40, out_gen=0.5, out_fixed=32))),
        CandidateWorkflow(
            "sum-extract-abstract", "Extract the key sentences, then write an abstract from them.",
            "Extract-then-abstract reduces hallucination: the writer only sees salient sentences.",
            (_llm("extract", "extractor", "List the key sentences of:\n{input}", in_ctx=1.0, in_fixed=40,
                  out_gen=0.4, out_fixed=40),
             _llm("abstract", "summarizer", "Write a summary from these key sentences:\n{extract}",
                  depends_on=("extract",), in_fixed=40, out_gen=0.5, out_fixed=32))),
    ),
)

MULTIHOP_QA = EvalTask(
    name="multihop_qa", title="Multi-hop question answering",
    description="Answer a question that needs facts from several documents of a corpus (HotpotQA-style).",
    min_accuracy=0.41, max_latency_s=30.0, nominal_rate_rps=CONV_RATE, home_trace="conv",
    why="Composing facts across documents needs the strongest models the router baseline has (alpha 0.41, at "
        "or below Qwen2.5-14B's 0.413, so every baseline can meet it); users accept ~30 s.",
    fixed_workflow="qa-decompose", fixed_rationale="Question decomposition + retrieval + answer, as LangChain's "
    "multi-query / decomposition retrievers do for multi-hop questions.",
    slo_k=5.0, slo_k_rationale="Research-style question: users accept waiting (5x).",
    candidates=(
        CandidateWorkflow(
            "qa-rag", "Retrieve passages once, then answer.",
            "Single retrieval + reading: cheapest RAG.",
            (_tool("retrieve", "retriever", "BM25 + dense top-8 passages for {input}", 0.15, 800),
             _llm("answer", "reader", "Passages:\n{retrieve}\nQuestion: {input}\nAnswer briefly.",
                  depends_on=("retrieve",), in_ctx=0.2, in_fixed=60, out_gen=0.25, out_fixed=16))),
        CandidateWorkflow(
            "qa-decompose", "Split the question into sub-questions, retrieve for each, then answer.",
            "Decomposition finds the bridge facts a single query misses.",
            (_llm("decompose", "planner", "Split into single-hop sub-questions:\n{input}", in_ctx=0.2,
                  in_fixed=80, out_fixed=48),
             _tool("retrieve", "retriever", "top-6 passages per sub-question of {decompose}", 0.3, 1200,
                   ("decompose",)),
             _llm("answer", "reader", "Passages:\n{retrieve}\nSub-questions:\n{decompose}\nQuestion: {input}\n"
                  "Answer briefly.", depends_on=("decompose", "retrieve"), in_ctx=0.2, in_fixed=60,
                  out_gen=0.25, out_fixed=16))),
        CandidateWorkflow(
            "qa-iterative", "Retrieve, find the bridge entity, retrieve again, then answer.",
            "Iterative retrieval follows the reasoning chain hop by hop.",
            (_tool("retrieve_1", "retriever", "top-4 passages for {input}", 0.15, 500),
             _llm("bridge", "reasoner", "Passages:\n{retrieve_1}\nQuestion: {input}\nWhich entity must we look up "
                  "next? Reply with a search query.", depends_on=("retrieve_1",), in_ctx=0.2, in_fixed=60,
                  out_fixed=32),
             _tool("retrieve_2", "retriever", "top-4 passages for {bridge}", 0.15, 500, ("bridge",)),
             _llm("answer", "reader", "Passages:\n{retrieve_1}\n{retrieve_2}\nQuestion: {input}\nAnswer briefly.",
                  depends_on=("retrieve_1", "retrieve_2"), in_ctx=0.2, in_fixed=60, out_gen=0.25,
                  out_fixed=16))),
    ),
)

TRANSLATE = EvalTask(
    name="translate", title="Translation",
    description="Translate a user's text into the requested language, keeping terminology consistent.",
    min_accuracy=0.30, max_latency_s=15.0, nominal_rate_rps=CONV_RATE, home_trace="conv",
    why="Fluent translation needs solid multilingual models (alpha 0.30); a page within ~15 s.",
    fixed_workflow="tr-post-edit", fixed_rationale="Translate then self-review/post-edit: the two-step chain "
    "LangChain translation examples use.",
    slo_k=4.0, slo_k_rationale="A page of text is read after a short wait (4x).",
    candidates=(
        # The text to translate is as long as the translation (the trace's generated tokens); a tenth of
        # the request context is kept as surrounding context for disambiguation.
        CandidateWorkflow(
            "tr-direct", "Translate in one call.",
            "One pass; cheapest.",
            (_llm("translate", "translator", "Translate into the target language:\n{input}", in_ctx=0.1,
                  in_gen=1.0, in_fixed=60, out_gen=1.1),)),
        CandidateWorkflow(
            "tr-post-edit", "Translate, then post-edit the draft against the source.",
            "A post-editing pass fixes omissions and mistranslations.",
            (_llm("translate", "translator", "Translate into the target language:\n{input}", in_ctx=0.1,
                  in_gen=1.0, in_fixed=60, out_gen=1.1),
             _llm("post_edit", "editor", "Source:\n{input}\nDraft translation:\n{translate}\n"
                  "Correct errors; output the final translation.", depends_on=("translate",), in_gen=1.0,
                  in_fixed=60, out_gen=1.1))),
        CandidateWorkflow(
            "tr-glossary", "Extract domain terms, look them up in a glossary, then translate with them.",
            "Terminology-constrained translation keeps product and legal terms consistent.",
            (_llm("terms", "terminologist", "List the domain-specific terms in:\n{input}", in_ctx=0.1,
                  in_gen=1.0, in_fixed=40, out_fixed=32),
             _tool("glossary", "glossary lookup", "look up {terms} in the customer's termbase", 0.05, 64,
                   ("terms",)),
             _llm("translate", "translator", "Glossary:\n{glossary}\nTranslate into the target language:\n{input}",
                  depends_on=("terms", "glossary"), in_ctx=0.1, in_gen=1.0, in_fixed=60, in_upstream=False,
                  out_gen=1.1))),
    ),
)

EXTRACT = EvalTask(
    name="extract", title="Information extraction",
    description="Extract entities and fields from a document into JSON that follows a given schema.",
    min_accuracy=0.15, max_latency_s=6.0, nominal_rate_rps=CODE_RATE, home_trace="code",
    why="Schema-guided extraction works with small models (alpha 0.15); it runs inside pipelines, so ~6 s.",
    fixed_workflow="ex-validate-repair", fixed_rationale="Structured output with a schema check and an "
    "OutputFixingParser-style repair call: LangChain's standard extraction pattern.",
    slo_k=2.0, slo_k_rationale="Runs inside other pipelines that wait on it (2x).",
    candidates=(
        CandidateWorkflow(
            "ex-direct", "Extract all fields in one call.",
            "One pass with the schema in the prompt.",
            (_llm("extract", "extractor", "Schema:\n<schema>\nExtract the fields as JSON from:\n{input}",
                  in_ctx=1.0, in_fixed=120, out_gen=1.0, out_fixed=16),)),
        CandidateWorkflow(
            "ex-validate-repair", "Extract, validate against the JSON schema, then repair.",
            "Schema validation catches malformed or missing fields; the repair stage sees the errors.",
            (_llm("extract", "extractor", "Schema:\n<schema>\nExtract the fields as JSON from:\n{input}",
                  in_ctx=1.0, in_fixed=120, out_gen=1.0, out_fixed=16),
             _tool("validate", "schema validator", "jsonschema validation of {extract}", 0.02, 40, ("extract",)),
             _llm("repair", "extractor", "Document:\n{input}\nJSON:\n{extract}\nErrors:\n{validate}\n"
                  "Return corrected JSON.", depends_on=("extract", "validate"), in_ctx=0.25, in_fixed=80,
                  out_gen=1.0, out_fixed=16))),
        CandidateWorkflow(
            "ex-parallel", "Entities and relations are extracted in parallel, then merged.",
            "Two focused prompts in parallel: each is simpler, and latency is the slower branch.",
            (_llm("entities", "extractor", "Extract the entities as JSON from:\n{input}", in_ctx=1.0, in_fixed=80,
                  out_gen=0.6, out_fixed=8),
             _llm("relations", "extractor", "Extract the relations as JSON from:\n{input}", in_ctx=1.0,
                  in_fixed=80, out_gen=0.6, out_fixed=8),
             _tool("merge", "merger", "merge {entities} and {relations} into the schema", 0.01, 0,
                   ("entities", "relations")))),
    ),
)

EVAL_TASKS: tuple[EvalTask, ...] = (CHAT, CODE, MATH, SUMMARIZE, MULTIHOP_QA, TRANSLATE, EXTRACT)


def get_task(name: str) -> EvalTask:
    """The evaluation task called `name`; NotFound names the known ones."""
    for t in EVAL_TASKS:
        if t.name == name:
            return t
    raise NotFound(f"unknown evaluation task {name!r}; known: {[t.name for t in EVAL_TASKS]}", field="task")


def nominal_workflows(task: str | EvalTask, trace: str | None = None) -> tuple[Workflow, ...]:
    """Shortcut: the task's 3 candidates sized at the median request of `trace` (default: its home trace)."""
    t = get_task(task) if isinstance(task, str) else task
    return t.nominal_workflows(trace)
