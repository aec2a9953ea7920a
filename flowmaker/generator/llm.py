"""LLM-backed workflow generator: asks any OpenAI-compatible endpoint for candidates constrained by a JSON
schema, validates them with the domain validator, and retries with the validation errors as feedback."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from flowmaker import telemetry
from flowmaker.cancel import offload
from flowmaker.domain import Workflow
from flowmaker.errors import FailedPrecondition, InvalidSpec, Unavailable
from flowmaker.generator.schema import ParsedAnswer, candidates_schema, parse_answer, structure_key, workflow_to_json
from flowmaker.generator.settings import GeneratorSettings
from flowmaker.generator.templates import family
from flowmaker.redact import scrub

log = logging.getLogger(__name__)

# Stable ErrorInfo reasons of this module's errors.
REASON_UNUSABLE = "GENERATOR_UNUSABLE_ANSWERS"  # answers kept failing validation
REASON_UNREACHABLE = "GENERATOR_UNREACHABLE"  # no answer at all: connection refused, 5xx, 429
REASON_TIMEOUT = "GENERATOR_TIMEOUT"  # no answer at all: every attempt ran past llm_timeout_s
REASON_REJECTED = "GENERATOR_REJECTED"  # the endpoint refused the request (4xx): retrying cannot help

_MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # of one chat completion; a larger answer is not read
_FEEDBACK_ECHO_CHARS = 6000  # how much of a bad answer to echo back; long answers would crowd the context


@dataclass(frozen=True, slots=True)
class Attempt:
    """One request to the endpoint and what came of it (for logs, tests and the error message)."""

    number: int
    outcome: str  # "ok", "invalid" (answer failed validation), "timeout", "unreachable", "bad_response"
    duration_s: float
    errors: tuple[str, ...] = ()  # validation problems or the transport error
    feedback: str = ""  # the message about the previous answer's problems that this request carried, if any
    valid_candidates: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    """The result of one generation: the candidates and every attempt it took."""

    workflows: tuple[Workflow, ...]
    attempts: tuple[Attempt, ...] = field(default_factory=tuple)


class _Transport(Exception):
    """A request that got no usable HTTP answer (retry without feedback)."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


def chat_completions_url(base_url: str) -> str:
    """`http://h:p` and `http://h:p/v1` (the OpenAI SDK's convention) both reach `/v1/chat/completions`."""
    b = base_url.rstrip("/")
    return f"{b}/chat/completions" if b.endswith("/v1") else f"{b}/v1/chat/completions"


def system_prompt(max_candidates: int) -> str:
    example = workflow_to_json(family("rag").candidates[1])
    return (
        "You design LLM workflows for a serving system that picks models and GPUs for each stage.\n"
        f"Given a task description, propose 1 to {max_candidates} candidate workflows that differ in structure "
        "(e.g. one cheap single call, a chain that checks or refines, a DAG with parallel branches or tools), "
        "so the system can trade accuracy for cost.\n"
        "Rules for each workflow:\n"
        "- stages form a DAG: depends_on lists ids of other stages of the same workflow; no cycles;\n"
        "- 1 to 3 stages of kind LLM; TOOL stages (retrieval, code execution, validation) are optional;\n"
        "- LLM stages: input_tokens > 0 and output_tokens > 0 are realistic per-call estimates, latency_s 0;\n"
        "- TOOL stages: input_tokens 0, output_tokens 0, latency_s the seconds the tool takes;\n"
        "- calls_per_request >= 1 (e.g. 3 to sample three answers and vote);\n"
        "- stage ids are identifiers (letters, digits, _); prompt_template is a Python str.format template "
        "that may use only {input} (the user's request) and {<id>} of the stages in its depends_on;\n"
        "- role is a short name for the stage; rationale is ONE line telling the user the trade-off.\n"
        "Answer with JSON only, matching the given schema: {\"candidates\": [...]}.\n"
        f"Example of one candidate:\n{json.dumps(example)}"
    )


class LlmGenerator:
    """Generator backed by an OpenAI-compatible chat completions endpoint."""

    name = "llm"

    def __init__(self, settings: GeneratorSettings, *, session: aiohttp.ClientSession | None = None) -> None:
        if not settings.llm_base_url:
            raise InvalidSpec("must be set to use the LLM generator", field="FLOWMAKER_GENERATOR_LLM_BASE_URL")
        if urlsplit(settings.llm_base_url).scheme not in ("http", "https"):
            raise InvalidSpec(f"must be an http(s) URL, got {settings.llm_base_url!r}",
                              field="FLOWMAKER_GENERATOR_LLM_BASE_URL")
        if not settings.llm_model:
            raise InvalidSpec("must name the model to ask when an LLM endpoint is configured",
                              field="FLOWMAKER_GENERATOR_LLM_MODEL")
        self.settings = settings
        self.url = chat_completions_url(settings.llm_base_url)
        self._session = session
        self._own_session = session is None

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> LlmGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _scrub(self, text: str) -> str:
        return scrub(text, [self.settings.llm_api_key.get_secret_value()])

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def generate(self, description: str, max_candidates: int = 3) -> tuple[Workflow, ...]:
        return (await self.generate_with_attempts(description, max_candidates)).workflows

    async def generate_with_attempts(self, description: str, max_candidates: int = 3) -> Generation:
        """Ask, validate, retry with feedback; return the valid, distinct candidates (at most
        `max_candidates`). Raises FailedPrecondition (GENERATOR_UNUSABLE_ANSWERS or
        GENERATOR_REJECTED) or Unavailable (GENERATOR_UNREACHABLE / GENERATOR_TIMEOUT)."""
        if not description or not description.strip():
            raise InvalidSpec("must not be empty: describe the task in a sentence", field="description")
        if max_candidates < 1:
            raise InvalidSpec(f"must be >= 1, got {max_candidates}", field="max_candidates")
        desc = description.strip()
        messages: list[dict[str, str]] = [
            {"role": "system", "content": system_prompt(max_candidates)},
            {"role": "user", "content": f"Task description: {desc}"},
        ]
        found: list[Workflow] = []
        keys: set[tuple[Any, ...]] = set()
        ids: set[str] = set()
        attempts: list[Attempt] = []
        feedback = ""
        for n in range(1, self.settings.llm_max_attempts + 1):
            t0 = time.monotonic()
            try:
                content, usage, cut_off = await self._complete(messages, max_candidates)
            except _Transport as e:
                attempts.append(Attempt(n, e.outcome, time.monotonic() - t0, (str(e),), feedback))
                log.warning("generator attempt %d/%d: %s", n, self.settings.llm_max_attempts, e)
                if n < self.settings.llm_max_attempts and e.outcome == "unreachable":
                    await asyncio.sleep(min(0.2 * 2 ** (n - 1), 2.0))  # let a restarting endpoint come back
                continue
            # Parsing and validating an answer is CPU work on model-sized text: off the event loop.
            parsed = await offload(parse_answer, content, max_candidates)
            if cut_off:  # truncated JSON: say why, so that the model shortens its answer
                parsed = ParsedAnswer(parsed.workflows, (
                    f"the answer was cut off at max_tokens={self.settings.llm_max_tokens}; propose fewer or "
                    "shorter candidates", *parsed.errors))
            new = 0
            for wf in parsed.workflows:
                key = structure_key(wf)
                if key in keys:  # same DAG, tokens and calls as one we have: the selector cannot tell them apart
                    continue
                keys.add(key)
                wid, k = wf.id, 2
                while wid in ids:  # distinct structures that the model happened to name alike
                    wid, k = f"{wf.id}-{k}", k + 1
                ids.add(wid)
                found.append(Workflow(id=wid, stages=wf.stages, description=desc, rationale=wf.rationale))
                new += 1
            ok = not parsed.errors
            attempts.append(Attempt(n, "ok" if ok else "invalid", time.monotonic() - t0, parsed.errors, feedback,
                                    new, usage.get("prompt_tokens"), usage.get("completion_tokens")))
            if (ok and found) or len(found) >= max_candidates:
                break
            log.info("generator attempt %d/%d: unusable answer: %s", n, self.settings.llm_max_attempts,
                     "; ".join(parsed.errors))
            # Feed the problems back in the conversation: the model sees what it said and why it failed.
            feedback = feedback_message(parsed.errors, len(found))
            messages = [*messages,
                        {"role": "assistant", "content": content[:_FEEDBACK_ECHO_CHARS]},
                        {"role": "user", "content": feedback}]
        if found:
            return Generation(tuple(found[:max_candidates]), tuple(attempts))
        raise self._failure(attempts)

    def _failure(self, attempts: list[Attempt]) -> FailedPrecondition | Unavailable:
        last = attempts[-1]
        meta = {"attempts": str(len(attempts)), "model": self.settings.llm_model, "endpoint": self.url}
        answered = [a for a in attempts if a.outcome in ("invalid", "ok", "bad_response")]
        if answered:
            a = answered[-1]
            return FailedPrecondition(
                f"the LLM's answers stayed unusable after {len(attempts)} attempt(s) "
                f"(model {self.settings.llm_model} at {self.url}); last problem: {'; '.join(a.errors)}",
                reason=REASON_UNUSABLE, metadata=meta | {"last_error": "; ".join(a.errors)[:500]})
        timeouts = all(a.outcome == "timeout" for a in attempts)
        return Unavailable(
            f"the LLM endpoint {self.url} gave no answer in {len(attempts)} attempt(s); last: {last.errors[0]}",
            reason=REASON_TIMEOUT if timeouts else REASON_UNREACHABLE, metadata=meta)

    async def _complete(self, messages: list[dict[str, str]],
                        max_candidates: int) -> tuple[str, dict[str, int], bool]:
        """One chat completion; returns (content, usage, cut off at max_tokens). Raises _Transport for retryable
        failures, FailedPrecondition for a request the endpoint refuses."""
        s = self.settings
        body = {
            "model": s.llm_model,
            "messages": messages,
            "temperature": s.llm_temperature,
            "max_tokens": s.llm_max_tokens,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "workflow_candidates", "strict": True,
                                                "schema": candidates_schema(max_candidates)}},
        }
        headers = {"Content-Type": "application/json"}
        if s.llm_api_key.get_secret_value():
            headers["Authorization"] = f"Bearer {s.llm_api_key.get_secret_value()}"
        with telemetry.llm_span(s.llm_model, max_tokens=s.llm_max_tokens, server_address=urlsplit(self.url).netloc,
                                attributes={"flowmaker.generator.attempt_messages": len(messages)}) as span:
            telemetry.inject_http_headers(headers)
            try:
                async with self._http().post(self.url, json=body, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=s.llm_timeout_s)) as resp:
                    raw = await resp.content.read(_MAX_RESPONSE_BYTES + 1)
                    status = resp.status
                if len(raw) > _MAX_RESPONSE_BYTES:
                    raise _Transport("bad_response", f"the answer exceeds {_MAX_RESPONSE_BYTES} bytes")
                text = raw.decode("utf-8", "replace")
            # (leaving the span with an exception marks it as an error)
            except TimeoutError:
                raise _Transport("timeout", f"timed out after {s.llm_timeout_s:g} s") from None
            except aiohttp.ClientError as e:
                raise _Transport("unreachable", self._scrub(f"{type(e).__name__}: {e}")) from None
            if status == 408 or status == 429 or status >= 500:
                raise _Transport("unreachable", f"HTTP {status}: {self._scrub(text[:2000])[:300]}")
            if status >= 400:
                # The body may echo our request, Authorization header included: scrubbed before it is
                # relayed to the caller or logged.
                raise FailedPrecondition(
                    f"the LLM endpoint {self.url} refused the request with HTTP {status}: "
                    f"{self._scrub(text[:2000])[:500]} "
                    "(does it serve the model and support response_format json_schema?)",
                    reason=REASON_REJECTED, metadata={"status": str(status), "model": s.llm_model})
            try:
                doc = json.loads(text)
                choice = doc["choices"][0]
                content = choice["message"]["content"]
                if not isinstance(content, str):
                    raise TypeError(f"content is {type(content).__name__}")
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise _Transport("bad_response", f"not an OpenAI chat completion response ({e!r}): "
                                 f"{self._scrub(text[:2000])[:300]}") from None
            usage = doc.get("usage") or {}
            telemetry.record_llm_usage(span, input_tokens=usage.get("prompt_tokens"),
                                       output_tokens=usage.get("completion_tokens"),
                                       response_model=doc.get("model"),
                                       finish_reasons=[choice.get("finish_reason") or ""])
            return (content, {k: v for k, v in usage.items() if isinstance(v, int)},
                    choice.get("finish_reason") == "length")


def feedback_message(errors: tuple[str, ...], kept: int) -> str:
    kept_line = (f" {kept} candidate(s) were fine and are kept; you may repeat them." if kept else "")
    return ("Your answer could not be used:\n" + "\n".join(f"- {e}" for e in errors) + "\n"
            f"Fix these problems and answer again with the complete JSON object.{kept_line}")
