"""Built-in template library: turns a task description into candidate workflows without an LLM, deterministically.

The description is classified into a task family by keywords; each family holds up
to three hand-written candidate workflows (1-3 LLM stages, some with TOOL stages or
parallel branches) whose stages carry a role, a `str.format` prompt template
(`{input}` and the ids of upstream stages), token estimates and dependencies. Where
the evaluation task set (`flowmaker.eval.tasks.EVAL_TASKS`) defines workflows for a
family, those are used instead, so that the generator, `make demo` and the
benchmarks agree on what a task's candidates are.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from flowmaker.domain import Stage, StageKind, Workflow
from flowmaker.errors import InvalidSpec

log = logging.getLogger(__name__)

GENERIC = "generic"
MAX_CANDIDATES = 3


@dataclass(frozen=True, slots=True)
class TemplateFamily:
    """A task family: how to recognise it and its candidate workflows (best first).

    `keywords` are lower-case words; a trailing `*` matches any word starting with
    the stem, and a keyword with a space matches that sequence of words."""

    name: str
    title: str
    keywords: tuple[str, ...]
    candidates: tuple[Workflow, ...]
    source: str = "builtin"  # "builtin", or "eval:<task name>" when taken from the evaluation task set


# --- stage builders: keep the family tables below readable ---------------------------------------

def _llm(id: str, role: str, prompt: str, inp: int, out: int, deps: Iterable[str] = (), calls: int = 1) -> Stage:
    return Stage(id=id, kind=StageKind.LLM, depends_on=tuple(deps), input_tokens=inp, output_tokens=out,
                 calls_per_request=calls, role=role, prompt_template=prompt)


def _tool(id: str, role: str, prompt: str, latency_s: float, deps: Iterable[str] = ()) -> Stage:
    return Stage(id=id, kind=StageKind.TOOL, depends_on=tuple(deps), latency_s=latency_s, role=role,
                 prompt_template=prompt)


def _wf(id: str, rationale: str, *stages: Stage) -> Workflow:
    return Workflow(id=id, stages=tuple(stages), rationale=rationale)


# --- the families -------------------------------------------------------------------------------
# Order matters: on a keyword tie the family listed first wins, so the more specific
# families (multi-hop QA, code, math...) come before the broad ones (RAG, chat).

_BUILTIN: tuple[TemplateFamily, ...] = (
    TemplateFamily(
        "multihop_qa", "Multi-hop question answering",
        ("multi hop", "multihop", "hotpot*", "2wiki*", "musique", "bridge", "compositional", "across documents",
         "multiple documents", "several documents", "reasoning chain", "multi step question*", "hops"),
        (
            _wf("multihop_qa-retrieve-answer",
                "Multi-hop QA, one retrieval then one reader call: cheapest, good when one search finds every fact.",
                _tool("retrieve", "retriever", "{input}", 0.05),
                _llm("answer", "reader",
                     "Answer the question using the passages; reason step by step over them.\n"
                     "Passages:\n{retrieve}\n\nQuestion: {input}\nAnswer:", 1800, 200, ["retrieve"])),
            _wf("multihop_qa-decompose",
                "Multi-hop QA, decompose first: an LLM splits the question into sub-questions before retrieval.",
                _llm("decompose", "question decomposer",
                     "Split this question into the simple sub-questions needed to answer it, one per line.\n"
                     "Question: {input}", 150, 80),
                _tool("retrieve", "retriever", "{decompose}", 0.08, ["decompose"]),
                _llm("answer", "reader",
                     "Answer the question from the passages, using the sub-questions as a plan.\n"
                     "Sub-questions:\n{decompose}\nPassages:\n{retrieve}\nQuestion: {input}\nAnswer:",
                     2000, 200, ["decompose", "retrieve"])),
            _wf("multihop_qa-iterative",
                "Multi-hop QA, two retrieval hops: a bridge step finds the intermediate entity, then a second search.",
                _tool("retrieve_hop1", "retriever (hop 1)", "{input}", 0.05),
                _llm("bridge", "bridge-entity finder",
                     "From the passages, name the intermediate entity needed to answer the question and write "
                     "a follow-up search query.\nPassages:\n{retrieve_hop1}\nQuestion: {input}",
                     1600, 60, ["retrieve_hop1"]),
                _tool("retrieve_hop2", "retriever (hop 2)", "{bridge}", 0.05, ["bridge"]),
                _llm("answer", "reader",
                     "Answer the question from both rounds of passages.\nFirst passages:\n{retrieve_hop1}\n"
                     "Bridge: {bridge}\nSecond passages:\n{retrieve_hop2}\nQuestion: {input}\nAnswer:",
                     2400, 150, ["retrieve_hop1", "bridge", "retrieve_hop2"])),
        )),
    TemplateFamily(
        "code", "Code generation",
        ("code", "coding", "coder", "program*", "python", "javascript", "typescript", "java", "rust", "golang",
         "c++", "sql", "function*", "script*", "debug*", "bug*", "refactor*", "implement*", "compile*",
         "humaneval", "mbpp", "leetcode", "unit test*", "snippet*", "regex"),
        (
            _wf("code-direct",
                "Code generation, single pass: one coder call writes the solution; lowest latency and cost.",
                _llm("code", "coder",
                     "Write a correct, self-contained solution for the following task. Return only code.\n"
                     "Task:\n{input}", 300, 400)),
            _wf("code-plan-implement",
                "Code generation, plan then implement: a planner outlines the approach, a coder follows it.",
                _llm("plan", "planner",
                     "Outline, as numbered steps, how to implement the following; name edge cases.\nTask:\n{input}",
                     300, 200),
                _llm("code", "coder",
                     "Implement the task following the plan. Return only code.\nTask:\n{input}\nPlan:\n{plan}",
                     550, 400, ["plan"])),
            _wf("code-test-repair",
                "Code generation with a test run: the code is executed against tests and repaired from failures.",
                _llm("code", "coder",
                     "Write a correct, self-contained solution for the following task. Return only code.\n"
                     "Task:\n{input}", 300, 400),
                _tool("run_tests", "test runner (sandbox)", "{code}", 0.5, ["code"]),
                _llm("repair", "debugger",
                     "Fix the code so that the tests pass; return the full corrected code.\nTask:\n{input}\n"
                     "Code:\n{code}\nTest output:\n{run_tests}", 900, 400, ["code", "run_tests"])),
        )),
    TemplateFamily(
        "math", "Math word problems",
        ("math*", "arithmetic*", "algebra*", "equation*", "calculat*", "gsm8k", "word problem*", "geometry",
         "proof*", "theorem*", "integral*", "probabilit*", "percentage*", "numeric*", "sum of", "compute"),
        (
            _wf("math-cot",
                "Math, chain of thought: one solver reasons step by step and states the final number.",
                _llm("solve", "solver",
                     "Solve the problem step by step, then give the final answer on the last line as "
                     "'Answer: <number>'.\nProblem: {input}", 200, 300)),
            _wf("math-self-consistency",
                "Math, self-consistency: three sampled solutions, the majority answer wins; more accurate, 3x tokens.",
                _llm("solve", "solver (3 samples)",
                     "Solve the problem step by step, then give the final answer on the last line as "
                     "'Answer: <number>'.\nProblem: {input}", 200, 300, calls=3),
                _tool("vote", "majority vote", "{solve}", 0.001, ["solve"])),
            _wf("math-solve-verify",
                "Math with a calculator check: a solver writes the arithmetic, a tool evaluates it, a verifier checks.",
                _llm("solve", "solver",
                     "Solve the problem step by step and write the arithmetic as one Python expression on the "
                     "last line.\nProblem: {input}", 200, 300),
                _tool("calculate", "calculator", "{solve}", 0.01, ["solve"]),
                _llm("verify", "verifier",
                     "Check the solution against the calculator result; correct it if needed and give the final "
                     "answer as 'Answer: <number>'.\nProblem: {input}\nSolution:\n{solve}\nCalculator: {calculate}",
                     550, 120, ["solve", "calculate"])),
        )),
    TemplateFamily(
        "translate", "Translation",
        ("translat*", "multilingual", "locali*", "english", "french", "german", "spanish", "italian",
         "portuguese", "chinese", "japanese", "korean", "russian", "arabic", "hindi", "into another language",
         "wmt*"),
        (
            _wf("translate-direct",
                "Translation, single pass: one translator call; cheapest and fastest.",
                _llm("translate", "translator",
                     "Translate the following text faithfully, keeping formatting and names.\nText:\n{input}",
                     400, 400)),
            _wf("translate-post-edit",
                "Translation with post-editing: a second call fixes fluency and terminology of the draft.",
                _llm("translate", "translator",
                     "Translate the following text faithfully, keeping formatting and names.\nText:\n{input}",
                     400, 400),
                _llm("post_edit", "post-editor",
                     "Improve the fluency and terminology of this translation without changing its meaning. "
                     "Return only the final translation.\nSource:\n{input}\nDraft:\n{translate}",
                     800, 400, ["translate"])),
            _wf("translate-ensemble",
                "Translation ensemble: literal and fluent drafts in parallel, then a reviewer merges the best of both.",
                _llm("literal", "literal translator",
                     "Translate the text as literally as correct grammar allows.\nText:\n{input}", 400, 400),
                _llm("fluent", "fluent translator",
                     "Translate the text idiomatically, as a native speaker would write it.\nText:\n{input}",
                     400, 400),
                _llm("merge", "reviewer",
                     "Combine the two translations into the most accurate and fluent one. Return only it.\n"
                     "Source:\n{input}\nLiteral:\n{literal}\nFluent:\n{fluent}", 1200, 400, ["literal", "fluent"])),
        )),
    TemplateFamily(
        "extract", "Information extraction",
        ("extract*", "entit*", "ner", "named entit*", "fields", "structured data", "structured output",
         "invoice*", "receipt*", "resume*", "cv", "key value", "slot*", "parse", "parsing", "scrape*",
         "fill in", "to json", "as json", "schema"),
        (
            _wf("extract-direct",
                "Extraction, single pass: one extractor returns the fields as JSON.",
                _llm("extract", "extractor",
                     "Extract the requested fields from the text and return them as a JSON object.\n"
                     "Text:\n{input}", 800, 200)),
            _wf("extract-validate-repair",
                "Extraction with validation: the JSON is checked against the schema and repaired on errors.",
                _llm("extract", "extractor",
                     "Extract the requested fields from the text and return them as a JSON object.\n"
                     "Text:\n{input}", 800, 200),
                _tool("validate", "schema validator", "{extract}", 0.005, ["extract"]),
                _llm("repair", "repairer",
                     "Fix the JSON so that it passes validation, using the text as ground truth.\nText:\n{input}\n"
                     "JSON:\n{extract}\nValidation errors:\n{validate}", 1100, 200, ["extract", "validate"])),
            _wf("extract-split",
                "Extraction split by kind: entities and relations extracted in parallel, then merged into one record.",
                _llm("entities", "entity extractor",
                     "List every named entity in the text with its type, as JSON.\nText:\n{input}", 800, 150),
                _llm("relations", "relation extractor",
                     "List the facts stated in the text as (subject, relation, object) JSON triples.\n"
                     "Text:\n{input}", 800, 200),
                _llm("merge", "record builder",
                     "Merge the entities and relations into one JSON record of the requested fields.\n"
                     "Request:\n{input}\nEntities:\n{entities}\nRelations:\n{relations}",
                     1150, 200, ["entities", "relations"])),
        )),
    TemplateFamily(
        "classify", "Classification",
        ("classif*", "categori*", "label*", "sentiment", "tag", "tagging", "triage*", "intent*", "moderat*",
         "spam", "toxic*", "topic*", "route", "routing", "detect*"),
        (
            _wf("classify-direct",
                "Classification, single pass: one classifier call returns the label; very short output.",
                _llm("classify", "classifier",
                     "Classify the text. Reply with the label only.\nText:\n{input}", 400, 8)),
            _wf("classify-vote",
                "Classification by vote: three sampled labels, the majority wins; steadier on borderline inputs.",
                _llm("classify", "classifier (3 samples)",
                     "Classify the text. Reply with the label only.\nText:\n{input}", 400, 8, calls=3),
                _tool("vote", "majority vote", "{classify}", 0.001, ["classify"])),
            _wf("classify-reason-label",
                "Classification with a rationale: an analyst reasons about the text, a second call picks the label.",
                _llm("analyse", "analyst",
                     "Explain briefly which category the text belongs to and why.\nText:\n{input}", 400, 120),
                _llm("label", "labeller",
                     "Given the analysis, reply with the label only.\nText:\n{input}\nAnalysis:\n{analyse}",
                     550, 8, ["analyse"])),
        )),
    TemplateFamily(
        "summarize", "Summarisation",
        ("summar*", "tldr", "tl dr", "digest", "condense*", "recap*", "key points", "shorten*", "synopsis",
         "abstractive", "cnn", "xsum", "meeting notes", "minutes"),
        (
            _wf("summarize-direct",
                "Summarisation, single pass: one summariser call; cheapest, fine when the text fits in context.",
                _llm("summarize", "summariser",
                     "Summarise the following text in a few sentences, keeping the key facts.\nText:\n{input}",
                     1500, 150)),
            _wf("summarize-draft-refine",
                "Summarisation, draft then refine: an editor checks the draft against the text for omissions.",
                _llm("draft", "summariser",
                     "Summarise the following text in a few sentences, keeping the key facts.\nText:\n{input}",
                     1500, 150),
                _llm("refine", "editor",
                     "Revise the summary so that it is faithful and complete; return only the summary.\n"
                     "Text:\n{input}\nDraft summary:\n{draft}", 1700, 150, ["draft"])),
            _wf("summarize-points-merge",
                "Summarisation in parallel: key points and a draft written side by side, then merged into one summary.",
                _llm("key_points", "key-point extractor",
                     "List the key facts of the text as short bullet points.\nText:\n{input}", 1500, 120),
                _llm("draft", "summariser",
                     "Summarise the following text in a few sentences.\nText:\n{input}", 1500, 150),
                _llm("merge", "editor",
                     "Write the final summary: the draft, corrected so that it covers every key point.\n"
                     "Key points:\n{key_points}\nDraft:\n{draft}", 350, 150, ["key_points", "draft"])),
        )),
    TemplateFamily(
        "rag", "Answering with retrieval",
        ("retriev*", "rag", "knowledge base", "document*", "docs", "corpus", "faq*", "search*", "cite",
         "citation*", "wiki*", "manual*", "question answering", "answer question*", "qa", "grounded"),
        (
            _wf("rag-retrieve-answer",
                "Retrieval-augmented answer: one search, one reader call grounded in the passages.",
                _tool("retrieve", "retriever", "{input}", 0.05),
                _llm("answer", "reader",
                     "Answer the question using only the passages; say so if they do not contain the answer.\n"
                     "Passages:\n{retrieve}\nQuestion: {input}\nAnswer:", 1500, 200, ["retrieve"])),
            _wf("rag-rewrite-retrieve-answer",
                "Retrieval with query rewriting: an LLM turns the question into a better search query first.",
                _llm("rewrite", "query rewriter",
                     "Rewrite the question as a concise search query.\nQuestion: {input}", 100, 30),
                _tool("retrieve", "retriever", "{rewrite}", 0.05, ["rewrite"]),
                _llm("answer", "reader",
                     "Answer the question using only the passages; say so if they do not contain the answer.\n"
                     "Passages:\n{retrieve}\nQuestion: {input}\nAnswer:", 1500, 200, ["retrieve"])),
            _wf("rag-rerank-answer",
                "Retrieval with reranking: an LLM keeps only the relevant passages, so the reader sees less noise.",
                _tool("retrieve", "retriever", "{input}", 0.05),
                _llm("rerank", "reranker",
                     "Copy out only the passages relevant to the question, most relevant first.\n"
                     "Passages:\n{retrieve}\nQuestion: {input}", 2500, 400, ["retrieve"]),
                _llm("answer", "reader",
                     "Answer the question using only the passages, citing them.\nPassages:\n{rerank}\n"
                     "Question: {input}\nAnswer:", 500, 200, ["rerank"])),
        )),
    TemplateFamily(
        "chat", "Chat",
        ("chat*", "conversation*", "conversational", "dialog*", "dialogue*", "assistant", "customer support",
         "support agent", "companion", "talk*", "small talk", "sharegpt", "multi turn", "persona"),
        (
            _wf("chat-direct",
                "Chat, single pass: one assistant call answers the conversation; lowest latency.",
                _llm("respond", "assistant",
                     "You are a helpful assistant. Continue the conversation.\n{input}\nAssistant:", 600, 250)),
            _wf("chat-memory",
                "Chat with memory: relevant earlier facts are looked up and given to the assistant.",
                _tool("recall", "memory lookup", "{input}", 0.02),
                _llm("respond", "assistant",
                     "You are a helpful assistant. Use the remembered facts when relevant.\nFacts:\n{recall}\n"
                     "Conversation:\n{input}\nAssistant:", 900, 250, ["recall"])),
            _wf("chat-review",
                "Chat with a reviewer: a second call checks the reply for mistakes and tone before it is sent.",
                _llm("respond", "assistant",
                     "You are a helpful assistant. Continue the conversation.\n{input}\nAssistant:", 600, 250),
                _llm("review", "reviewer",
                     "Check the reply for factual errors and tone; return the improved reply only.\n"
                     "Conversation:\n{input}\nReply:\n{respond}", 850, 250, ["respond"])),
        )),
)

_GENERIC_FAMILY = TemplateFamily(
    GENERIC, "Generic task", (),
    (
        _wf("generic-direct",
            "No known task family recognised, so a generic plan: one assistant call does the whole task.",
            _llm("respond", "assistant", "Carry out the following task.\n{input}", 500, 300)),
        _wf("generic-plan-execute",
            "No known task family recognised, so a generic plan: a planner breaks the task down, an executor does it.",
            _llm("plan", "planner", "Break the following task into short numbered steps.\nTask:\n{input}", 400, 150),
            _llm("execute", "executor", "Carry out the task following the plan.\nTask:\n{input}\nPlan:\n{plan}",
                 600, 300, ["plan"])),
        _wf("generic-draft-review",
            "No known task family recognised, so a generic plan: a draft, then a reviewer corrects it.",
            _llm("draft", "assistant", "Carry out the following task.\n{input}", 500, 300),
            _llm("review", "reviewer",
                 "Check the answer for mistakes and omissions; return the corrected answer only.\nTask:\n{input}\n"
                 "Answer:\n{draft}", 850, 300, ["draft"])),
    ))


# --- classification -----------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9+#]+")


def _words(text: str) -> tuple[str, ...]:
    # "multi-hop", "multi_hop" and "multi hop" all become ("multi", "hop").
    return tuple(_WORD.findall(text.lower().replace("_", " ")))


def _match_at(keyword: str, words: tuple[str, ...]) -> int | None:
    """Index of the first word where `keyword` matches, or None."""
    parts = keyword.split()
    for i in range(len(words) - len(parts) + 1):
        if all(words[i + j].startswith(p[:-1]) if p.endswith("*") else words[i + j] == p
               for j, p in enumerate(parts)):
            return i
    return None


def _score(family: TemplateFamily, words: tuple[str, ...]) -> tuple[int, int]:
    """(matching keywords, -position of the earliest match): more matches win, then the
    family named earlier in the description ("summarise this code" is summarisation)."""
    hits = [i for i in (_match_at(k, words) for k in family.keywords) if i is not None]
    return (len(hits), -min(hits)) if hits else (0, 0)


def classify(description: str) -> str:
    """The task family a description belongs to: the family with the most matching
    keywords, then the earliest match, then the one listed first; `"generic"` when
    nothing matches."""
    words = _words(description)
    best, best_score = GENERIC, (0, 0)
    for fam in families():
        if fam.name == GENERIC:
            continue
        s = _score(fam, words)
        if s[0] > 0 and s > best_score:
            best, best_score = fam.name, s
    return best


# --- the evaluation task set ------------------------------------------------------------------

def _eval_tasks() -> tuple[tuple[str, str, tuple[Workflow, ...]], ...]:
    """(name, description, nominal workflows) of each evaluation task, or () while
    flowmaker.eval.tasks is absent. The evaluation area owns that module; its task
    names are the family names here ("code", "math", "summarize", ...)."""
    try:
        mod = importlib.import_module("flowmaker.eval.tasks")
    except ModuleNotFoundError as e:
        if e.name not in ("flowmaker.eval.tasks", "flowmaker.eval"):
            raise
        return ()
    return tuple((t.name, t.description, tuple(t.nominal_workflows())) for t in getattr(mod, "EVAL_TASKS", ()))


def _fill_from_eval(fam: TemplateFamily, task_name: str, wfs: tuple[Workflow, ...]) -> TemplateFamily:
    filled = []
    for w in wfs:
        try:
            w.validate()
        except InvalidSpec as e:  # the evaluation area's data is not ours to fix; keep the builtin ones
            log.warning("evaluation task %s: workflow %s is invalid (%s); using the built-in templates",
                        task_name, w.id, e)
            return fam
        # An evaluation candidate says what it does (description) and why (rationale):
        # the user approving it sees both, on one line.
        line = " ".join(p.strip() for p in (w.description, w.rationale) if p.strip()).replace("\n", " ")
        if not line:
            line = f"{fam.title}: " + ", ".join(s.role or s.id for s in w.stages) + "."
        filled.append(dataclasses.replace(w, rationale=line))
    if not filled:
        return fam
    return dataclasses.replace(fam, candidates=tuple(filled[:MAX_CANDIDATES]), source=f"eval:{task_name}")


@functools.cache
def families() -> tuple[TemplateFamily, ...]:
    """Every family, in tie-break order, with the generic fallback last. A family
    that an evaluation task belongs to takes that task's workflows."""
    fams = list(_BUILTIN)
    taken: set[str] = set()
    for name, desc, wfs in _eval_tasks():
        # by name first; a task named otherwise goes to the family its words suggest
        best = next((i for i, f in enumerate(fams) if f.name == name), None)
        if best is None:
            words, best_score = _words(f"{name} {desc}"), (0, 0)
            for i, fam in enumerate(fams):
                s = _score(fam, words)
                if s[0] > 0 and s > best_score:
                    best, best_score = i, s
        if best is None or fams[best].name in taken:
            continue
        taken.add(fams[best].name)
        fams[best] = _fill_from_eval(fams[best], name, wfs)
    return (*fams, _GENERIC_FAMILY)


def family(name: str) -> TemplateFamily:
    for fam in families():
        if fam.name == name:
            return fam
    raise InvalidSpec(f"unknown task family {name!r}; known: {[f.name for f in families()]}", field="family")


def generate_from_templates(description: str, max_candidates: int = MAX_CANDIDATES) -> tuple[Workflow, ...]:
    """Up to `max_candidates` (each family has at most 3) candidate workflows for
    `description`, best first, each valid (`Workflow.validate()`) and carrying the
    description. Deterministic: same input, same output."""
    if not description or not description.strip():
        raise InvalidSpec("must not be empty: describe the task in a sentence", field="description")
    if max_candidates < 1:
        raise InvalidSpec(f"must be >= 1, got {max_candidates}", field="max_candidates")
    fam = family(classify(description))
    desc = description.strip()
    return tuple(dataclasses.replace(w, description=desc).validate()
                 for w in fam.candidates[:max_candidates])
