"""The emulated engine: an OpenAI-compatible HTTP server whose timing follows `EngineModel` in (scaled) real time.

Run: `python -m flowmaker.engine.server --model NAME --profile-json '{...}' --host 127.0.0.1 --port 0`.
It prints one line `LISTENING <port>` on stdout once bound (useful with `--port 0`) (and writes the
port to `--port-file` when given), so a parent can find it.

Conventions (documented because clients and tests rely on them):
* A "token" is a whitespace-separated word, both for the prompt (`usage.prompt_tokens`) and
  the output. The output is deterministic filler of exactly `max_tokens` words
  (`max_completion_tokens` is accepted too for chat; default 16, the OpenAI completions default).
  `finish_reason` is "length".
* Sampling (`temperature`, `top_p`, the penalties, `seed`, `stop`) is checked against OpenAI's ranges (400
  naming the parameter, `flowmaker.sampling`) and shapes the output so a client can see it arrived: greedy
  (`temperature` 0 or `top_p` 0) or nothing set: the filler above; a `seed`: words drawn by a generator
  seeded with it (the same seed, the same answer); `temperature` > 0 without a seed: words drawn at random.
  The output ends before the first `stop` sequence in it, with `finish_reason` "stop" (and takes only the
  tokens kept).
* Tracing: each completion is a SERVER span `chat <model>` (or `text_completion <model>`), the child of the
  caller's span when the request carries a W3C `traceparent` (the orchestrator's calls do), with the
  `gen_ai.*` request, sampling and usage attributes; exported as the OTEL_* settings say (default: none).
* Chat prompt tokens: the words of every message's text content (string or `text` parts).
  Completions prompt: words of the string(s), or the length of a token-id list.
* Timing: each request is submitted to the model at arrival; the response (or each streamed
  chunk) is released when the model's clock, which runs at `--time-scale` times wall speed,
  reaches the matching token time. Latency metrics are in model seconds.
* `--script FILE.json`: a JSON list of canned responses `{"content": str, "delay_s": float,
  "status": int (optional, default 200)}` returned in order, whatever the request asks for;
  `delay_s` is wall-clock seconds (not scaled) so it can outlast a client's timeout; a
  `status` other than 200 returns an OpenAI error with `content` as the message. When the
  list is used up every further request gets 500 "script exhausted".
* `--crash-after N`: the process exits abruptly (os._exit, code 17) right after the N-th
  completion response has been sent.
* Metrics use vLLM's names (`vllm:num_requests_running`, ...), so one scraper reads both.
  FlowMaker's own: `flowmaker_engine_busy_seconds_total` (model seconds with a non-empty batch),
  `flowmaker_engine_gpu_speed` (the GPU share it runs at: 1 alone) and
  `flowmaker_engine_gpu_busy_neighbours` (the most other busy engines on any of its GPUs).
* GPU sharing (`--gpu-ids g0,g1 --gpu-share-dir DIR`, both or neither; the deployer passes them to
  every emulated engine of its node): engines started with the same DIR share the GPUs they name,
  as the simulator's `colocation="dynamic"` does. While it has a call in flight an engine is busy
  and marks itself so on each of its GPUs (`flowmaker.engine.gpu_share`); every few ms of wall time
  (`--gpu-share-poll-ms`) while busy, and at each arrival, it counts the busy engines on its GPUs
  and runs at speed 1/k (`EngineModel.set_speed`), k = the most busy engines on any of its GPUs,
  itself included. Marks of dead engines (killed with SIGKILL) are ignored. Without the flags an
  engine runs alone (speed 1), as before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flowmaker import telemetry
from flowmaker.cancel import wait_for
from flowmaker.domain import Profile, ProfileSource
from flowmaker.engine.gpu_share import GpuShare
from flowmaker.engine.model import Completion, EngineModel
from flowmaker.errors import InvalidSpec
from flowmaker.limits import json_depth
from flowmaker.sampling import Sampling

API_KEY_ENV = "FLOWMAKER_ENGINE_API_KEY"  # vLLM reads VLLM_API_KEY the same way
DEFAULT_MAX_TOKENS = 16
DEFAULT_MAX_MODEL_LEN = 131_072  # prompt + completion tokens of one request (vLLM's --max-model-len)
DEFAULT_GPU_SHARE_POLL_S = 0.002  # wall seconds between re-reads of the GPUs' busy marks while busy
MAX_JSON_DEPTH = 64  # of a request body; deeper nesting is refused before parsing
CRASH_EXIT_CODE = 17
_FILLER = ("the quick brown fox jumps over a lazy dog while seven engines emulate "
           "continuous batching of tokens for flowmaker").split()


def profile_to_json(p: Profile) -> str:
    d = asdict(p)
    d["source"] = p.source.value
    return json.dumps(d, separators=(",", ":"))


def profile_from_json(text: str) -> Profile:
    """Parse `--profile-json`; raise ValueError naming the bad field."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"profile_json: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError("profile_json: must be a JSON object")
    d = dict(d)
    d.setdefault("model_id", "emulated")
    d.setdefault("tp", 1)
    d.setdefault("pp", 1)
    d.setdefault("memory_gb_per_gpu", 0.0)
    for f in ("fixed_s", "prefill_s_per_token", "decode_s_per_token", "max_output_tokens_per_s"):
        if f not in d:
            raise ValueError(f"profile_json.{f}: required")
    known = set(Profile.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"profile_json.{unknown[0]}: unknown field")
    try:
        d["source"] = ProfileSource(d.get("source", "ANALYTIC"))
    except ValueError:
        raise ValueError(f"profile_json.source: must be one of {[s.value for s in ProfileSource]}") from None
    try:
        return Profile(**d).validate("profile_json")
    except TypeError as e:
        raise ValueError(f"profile_json: {e}") from None
    except Exception as e:  # InvalidSpec carries the field
        raise ValueError(str(e)) from None


def count_tokens(text: str) -> int:
    return len(text.split())


def filler_words(n: int) -> list[str]:
    return [_FILLER[i % len(_FILLER)] for i in range(n)]


def output_words(n: int, sampling: Sampling | None) -> tuple[list[str], str]:
    """The answer of `n` tokens under `sampling` (the module docstring) and its finish_reason."""
    if sampling is None or sampling.greedy or (sampling.seed is None and sampling.temperature is None):
        words = filler_words(n)
    else:  # seeded: reproducible; else fresh randomness for every request
        rng = random.Random(sampling.seed)
        words = [rng.choice(_FILLER) for _ in range(n)]
    if sampling is not None and sampling.stop:
        text, hit = sampling.cut(" ".join(words))
        if hit:
            return text.split(), "stop"
    return words, "length"


@dataclass(frozen=True, slots=True)
class ScriptEntry:
    content: str
    delay_s: float = 0.0
    status: int = 200


def load_script(path: str) -> list[ScriptEntry]:
    """Read a `--script` file; raise ValueError naming the bad entry/field."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"script: cannot read {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError("script: must be a JSON list of {content, delay_s}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise ValueError(f"script[{i}].content: must be a string")
        delay = item.get("delay_s", 0.0)
        if not isinstance(delay, int | float) or delay < 0:
            raise ValueError(f"script[{i}].delay_s: must be a number >= 0")
        status = item.get("status", 200)
        if not isinstance(status, int) or not 100 <= status <= 599:
            raise ValueError(f"script[{i}].status: must be an HTTP status code")
        out.append(ScriptEntry(item["content"], float(delay), status))
    return out


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_response(message: str, param: str | None = None, status: int = 400, code: str | None = None,
                   type_: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status)


@dataclass
class _Pending:
    """A request inside the model: the scheduler wakes `changed` whenever tokens come out."""

    out_tokens: int
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    completion: Completion | None = None
    emitted: int = 0


class _ModelCollector(Collector):
    """Exports the model's live gauges and counters at scrape time (no bookkeeping twice)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine

    def collect(self):  # type: ignore[no-untyped-def]
        m = self.engine.model
        labels = ["model_name"]
        name = [self.engine.model_name]

        def gauge(metric: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=labels)
            g.add_metric(name, v)
            return g

        def counter(metric: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=labels)
            c.add_metric(name, v)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", m.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission.", m.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1.", m.kv_usage)
        yield counter("vllm:generation_tokens", "Output tokens produced.", m.tokens_emitted)
        yield counter("vllm:prompt_tokens", "Prompt tokens prefilled.", m.prompt_tokens_processed)
        yield counter("vllm:request_success", "Requests finished.", self.engine.requests_finished)
        yield counter("flowmaker:request_cancelled", "Requests dropped because their client went away.",
                      self.engine.requests_cancelled)
        yield counter("flowmaker_engine_busy_seconds", "Model seconds with a non-empty batch (at any speed).",
                      m.busy_s)
        yield gauge("flowmaker_engine_gpu_speed", "GPU share this engine runs at (while busy) or would start at: "
                    "1 / (1 + the most other busy engines on any of its GPUs); 1 when not sharing.", m.speed)
        yield gauge("flowmaker_engine_gpu_busy_neighbours", "The most other busy engines on any one of this "
                    "engine's GPUs (0 when not sharing).", self.engine.gpu_neighbours)


class EmulatedEngine:
    """The HTTP application around one `EngineModel` (or a script)."""

    def __init__(self, model_name: str, profile: Profile, *, time_scale: float = 1.0, max_batch: int = 256,
                 kv_capacity_tokens: int | None = None, script: list[ScriptEntry] | None = None,
                 crash_after: int | None = None, clock: Callable[[], float] = time.monotonic,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, api_key: str = "",
                 gpu_share: GpuShare | None = None, gpu_share_poll_s: float = DEFAULT_GPU_SHARE_POLL_S) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale: must be > 0, got {time_scale}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {max_model_len}")
        if not gpu_share_poll_s > 0:
            raise ValueError(f"gpu_share_poll_s: must be > 0, got {gpu_share_poll_s}")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.profile = profile
        self.model = EngineModel(profile, max_batch=max_batch, kv_capacity_tokens=kv_capacity_tokens)
        self.time_scale = time_scale
        self.script = script
        self._script_pos = 0
        self.crash_after = crash_after
        self.gpu_share = gpu_share  # None: alone on its GPUs (speed 1)
        self.gpu_share_poll_s = gpu_share_poll_s
        self.gpu_neighbours = 0  # the most other busy engines on one of its GPUs, at the last look
        self._share_error = ""
        self.requests_finished = 0
        self.requests_cancelled = 0
        self._clock = clock
        self._t0 = clock()
        self._created = int(time.time())  # /v1/models `created`: Unix seconds (the clock above may be monotonic)
        self._pending: dict[str, _Pending] = {}
        self._submit_times: dict[str, float] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_ModelCollector(self))
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency (model seconds).",
                             ["model_name"], registry=self.registry, buckets=buckets)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (model seconds).",
                              ["model_name"], registry=self.registry, buckets=buckets)

    # ---- clock and scheduler -----------------------------------------------------------

    def model_now(self) -> float:
        return (self._clock() - self._t0) * self.time_scale

    def _tick(self) -> None:
        """Bring the model up to now (and, when sharing, its busy marks and speed); wake the waiting handlers."""
        now = max(self.model.now, self.model_now())
        done = self.model.advance(now)
        if self.gpu_share is not None:
            done += self._share_sync(now)
        for c in done:
            p = self._pending.pop(c.req_id, None)
            if p is not None:
                p.completion = c
                p.emitted = p.out_tokens
                p.changed.set()
            sub = self._submit_times.pop(c.req_id, c.finish_time)
            self.e2e.labels(self.model_name).observe(c.finish_time - sub)
            self.ttft.labels(self.model_name).observe(c.first_token_time - sub)
        for rid, p in self._pending.items():
            n = self.model.emitted(rid)
            if n > p.emitted:
                p.emitted = n
                p.changed.set()

    def _share_sync(self, now: float) -> list[Completion]:
        """Publish whether this engine is busy (a call in flight) and run at 1 / (1 + the most other busy
        engines on any of its GPUs) from `now` on: the simulator's dynamic co-location rule."""
        share = self.gpu_share
        assert share is not None
        try:
            share.set_busy(self.model.in_flight > 0)
            self.gpu_neighbours = share.busy_others()
        except OSError as e:  # the share directory is broken: keep the last speed, say so once
            if str(e) != self._share_error:
                self._share_error = str(e)
                print(f"gpu sharing: {e}; keeping speed {self.model.speed:g}", file=sys.stderr, flush=True)
            return []
        return self.model.set_speed(1.0 / (1 + self.gpu_neighbours), now)

    async def _scheduler(self) -> None:
        while True:
            self._tick()
            nxt = self.model.next_step_time()
            self._wake.clear()
            timeout = None if nxt is None else max(0.0, (nxt - self.model_now()) / self.time_scale)
            if self.gpu_share is not None and self.model.in_flight > 0:  # neighbours come and go: look again
                timeout = self.gpu_share_poll_s if timeout is None else min(timeout, self.gpu_share_poll_s)
            try:
                await wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    async def start(self, app: web.Application) -> None:
        self._t0 = self._clock()
        self._task = asyncio.create_task(self._scheduler())

    async def stop(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.gpu_share is not None:
            with contextlib.suppress(OSError):
                self.gpu_share.close()  # no longer busy, whatever was in flight

    def _submit(self, in_tokens: int, out_tokens: int) -> tuple[str, _Pending]:
        rid = f"req-{next(self._ids)}"
        now = max(self.model.now, self.model_now())
        try:
            self.model.submit(rid, in_tokens, out_tokens, now)
        except ValueError as e:
            raise BadRequest(str(e).replace("in_tokens", "prompt+max_tokens"), "max_tokens") from None
        p = _Pending(out_tokens)
        self._pending[rid] = p
        self._submit_times[rid] = now
        if self.gpu_share is not None:
            self._tick()  # mark busy and take the GPU share before the request's first step is planned
        self._wake.set()
        return rid, p

    def _request_done(self) -> None:
        self.requests_finished += 1
        if self.crash_after is not None and self.requests_finished >= self.crash_after:
            # Let the response bytes leave, then die without cleanup, like a crashed engine.
            asyncio.get_running_loop().call_later(0.05, os._exit, CRASH_EXIT_CODE)

    # ---- request parsing ---------------------------------------------------------------

    def _common(self, body: Any) -> tuple[dict[str, Any], int, bool]:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", None)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest("'model' must be a string", "model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", "model", 404, "model_not_found")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        pname = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"'{pname}' must be an integer >= 1, got {str(max_tokens)[:40]}", pname)
        if max_tokens > self.max_model_len:
            raise BadRequest(f"'{pname}' is {max_tokens}, more than this model's maximum context length "
                             f"of {self.max_model_len} tokens", pname)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", "stream")
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("only n=1 is supported", "n")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
            raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
        return body, max_tokens, stream

    @staticmethod
    def _include_usage(body: dict[str, Any]) -> bool:
        """OpenAI streams carry usage only when asked: `stream_options.include_usage` adds one last chunk
        with empty `choices` and the usage (every other chunk then has `usage: null`)."""
        return bool((body.get("stream_options") or {}).get("include_usage", False))

    @staticmethod
    def _chat_prompt_tokens(body: dict[str, Any]) -> int:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        total = 0
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}].role: must be a string", f"messages[{i}].role")
            content = m.get("content")
            if content is None:
                continue
            if isinstance(content, str):
                total += count_tokens(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        total += count_tokens(part["text"])
            else:
                raise BadRequest(f"messages[{i}].content: must be a string or a list of parts",
                                 f"messages[{i}].content")
        return total

    @staticmethod
    def _completion_prompt_tokens(body: dict[str, Any]) -> int:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return count_tokens(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            return len(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            if len(prompt) > 1:
                raise BadRequest("only one prompt per request is supported", "prompt")
            return count_tokens(prompt[0])
        raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")

    # ---- handlers ----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        # Its span joins the caller's trace (the orchestrator's `chat` span sends a traceparent).
        with telemetry.engine_span(self.model_name, request.headers,
                                   operation="chat" if chat else "text_completion") as span:
            resp = await self._handle_traced(request, chat, span)
            if resp.status >= 400:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {resp.status}"))
            return resp

    async def _handle_traced(self, request: web.Request, chat: bool, span: Any) -> web.StreamResponse:
        try:
            if not self._authorized(request):
                return error_response("invalid or missing API key", None, 401, "invalid_api_key")
            try:
                text = await request.text()
            except UnicodeDecodeError:
                raise BadRequest("request body is not valid JSON", None) from None
            if json_depth(text) > MAX_JSON_DEPTH:  # json.loads would recurse until RecursionError
                raise BadRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels", None)
            try:
                raw = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                raise BadRequest("request body is not valid JSON", None) from None
            body, max_tokens, stream = self._common(raw)
            in_tokens = self._chat_prompt_tokens(body) if chat else self._completion_prompt_tokens(body)
            if in_tokens + max_tokens > self.max_model_len:
                raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                 f"you requested {in_tokens + max_tokens} tokens ({in_tokens} in the messages, "
                                 f"{max_tokens} in the completion).", "max_tokens")
            try:
                sampling = Sampling.from_openai(body)
            except InvalidSpec as e:
                raise BadRequest(f"'{e.field}' {e.message}", e.field) from None
            span.set_attributes({telemetry.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
                                 telemetry.GEN_AI_USAGE_INPUT_TOKENS: in_tokens,
                                 **telemetry.sampling_attributes(sampling.body())})
            with_usage = stream and self._include_usage(body)
            if self.script is not None:
                return await self._scripted(request, chat, in_tokens, stream, with_usage)
            words, finish = output_words(max_tokens, sampling if sampling.is_set else None)
            rid, p = self._submit(in_tokens, max(1, len(words)))  # a stop sequence ends it early
        except BadRequest as e:
            return error_response(e.message, e.param, e.status, e.code)
        span.set_attribute(telemetry.GEN_AI_RESPONSE_ID, rid)
        telemetry.record_llm_usage(span, input_tokens=in_tokens, output_tokens=len(words),
                                   response_model=self.model_name, finish_reasons=[finish])
        try:
            return await self._respond(request, chat, rid, p, in_tokens, words, finish, stream, with_usage)
        except (asyncio.CancelledError, ConnectionResetError):
            self._abandon(rid)
            raise

    def _abandon(self, rid: str) -> None:
        """The client went away (disconnect, or its own deadline): drop the request from the engine."""
        self._pending.pop(rid, None)
        self._submit_times.pop(rid, None)
        if self.model.cancel(rid, max(self.model.now, self.model_now())):
            self.requests_cancelled += 1
            if self.gpu_share is not None:
                self._tick()  # idle now? then the neighbours may speed up at once
            self._wake.set()

    async def _respond(self, request: web.Request, chat: bool, rid: str, p: _Pending, in_tokens: int,
                       words: list[str], finish: str, stream: bool, with_usage: bool) -> web.StreamResponse:
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        created = int(time.time())
        usage = {"prompt_tokens": in_tokens, "completion_tokens": len(words),
                 "total_tokens": in_tokens + len(words)}
        if not stream:
            while p.completion is None:
                p.changed.clear()
                await p.changed.wait()
            resp = web.json_response(self._full(chat, oid, created, " ".join(words), finish, usage))
            self._request_done()
            return resp
        sresp = await self._open_stream(request)
        sent = 0
        first = True
        while True:
            p.changed.clear()
            for i in range(sent, min(p.emitted, len(words))):  # no word at all when a stop cut it at once
                piece = words[i] if i == 0 else " " + words[i]
                await self._send(sresp, self._chunk(chat, oid, created, piece, None, first, with_usage=with_usage))
                first = False
            sent = p.emitted
            if p.completion is not None:
                break
            await p.changed.wait()
        await self._send(sresp, self._chunk(chat, oid, created, "", finish, False, with_usage=with_usage))
        if with_usage:
            await self._send(sresp, self._usage_chunk(chat, oid, created, usage))
        await sresp.write(b"data: [DONE]\n\n")
        await sresp.write_eof()
        self._request_done()
        return sresp

    async def _scripted(self, request: web.Request, chat: bool, in_tokens: int, stream: bool,
                        with_usage: bool = False) -> web.StreamResponse:
        assert self.script is not None
        if self._script_pos >= len(self.script):
            return error_response(f"script exhausted: all {len(self.script)} responses used", None, 500, None,
                                  "server_error")
        entry = self.script[self._script_pos]
        self._script_pos += 1
        if entry.delay_s:
            await asyncio.sleep(entry.delay_s)
        if entry.status != 200:
            self._request_done()
            return error_response(entry.content, None, entry.status, None,
                                  "invalid_request_error" if entry.status < 500 else "server_error")
        oid = ("chatcmpl-" if chat else "cmpl-") + f"script-{self._script_pos - 1}"
        created = int(time.time())
        n_out = count_tokens(entry.content)
        usage = {"prompt_tokens": in_tokens, "completion_tokens": n_out, "total_tokens": in_tokens + n_out}
        resp: web.StreamResponse
        if not stream:
            resp = web.json_response(self._full(chat, oid, created, entry.content, "stop", usage))
        else:
            resp = await self._open_stream(request)
            await self._send(resp, self._chunk(chat, oid, created, entry.content, None, True, with_usage=with_usage))
            await self._send(resp, self._chunk(chat, oid, created, "", "stop", False, with_usage=with_usage))
            if with_usage:
                await self._send(resp, self._usage_chunk(chat, oid, created, usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        self._request_done()
        return resp

    def _full(self, chat: bool, oid: str, created: int, text: str, finish: str,
              usage: dict[str, int]) -> dict[str, Any]:
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": finish, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": oid, "object": obj, "created": created, "model": self.model_name,
                "choices": [choice], "usage": usage}

    def _chunk(self, chat: bool, oid: str, created: int, piece: str, finish: str | None, first: bool, *,
               with_usage: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"content": piece} if piece or not finish else {}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece, "finish_reason": finish}
            obj = "text_completion"
        out: dict[str, Any] = {"id": oid, "object": obj, "created": created, "model": self.model_name,
                               "choices": [choice]}
        if with_usage:
            out["usage"] = None
        return out

    def _usage_chunk(self, chat: bool, oid: str, created: int, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": oid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": [], "usage": usage}

    @staticmethod
    async def _open_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return error_response("invalid or missing API key", None, 401, "invalid_api_key")
        return web.json_response({"object": "list", "data": [
            self._model_card()]})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "flowmaker"}

    async def get_model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card, or OpenAI's 404 `model_not_found`."""
        if not self._authorized(request):
            return error_response("invalid or missing API key", None, 401, "invalid_api_key")
        mid = request.match_info["model"]
        if mid != self.model_name:
            return error_response(f"The model `{mid}` does not exist.", "model", 404, "model_not_found")
        return web.json_response(self._model_card())

    def _authorized(self, request: web.Request) -> bool:
        """With an API key (the deployer's per-instance key), /v1/* needs `Authorization: Bearer <key>`,
        as vLLM's --api-key does; /health and /metrics stay open to the node's probes."""
        if not self.api_key:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def metrics(self, request: web.Request) -> web.Response:
        # Bring the model up to date so gauges reflect "now", not the last wake-up.
        if self.gpu_share is not None:
            self._tick()  # an idle engine does not poll its neighbours: look now
        self._wake.set()
        return web.Response(body=generate_latest(self.registry), content_type="text/plain",
                            charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


async def serve(engine: EmulatedEngine, host: str, port: int, port_file: str | None = None,
                announce: bool = True) -> None:
    """Run until cancelled or SIGTERM/SIGINT; print `LISTENING <port>` when `announce`."""
    import signal

    # handler_cancellation: a client that disconnects cancels its handler, which drops its request from the
    # batch (`_abandon`), so the engine stops spending tokens on an answer nobody reads.
    runner = web.AppRunner(engine.app(), handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    if port_file:
        tmp = port_file + ".tmp"
        Path(tmp).write_text(str(bound))
        os.replace(tmp, port_file)  # atomic: a reader never sees a half-written port
    if announce:
        print(f"LISTENING {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flowmaker.engine.server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="served model name (what /v1/models lists)")
    ap.add_argument("--profile-json", help="Profile as JSON (fixed_s, prefill_s_per_token, decode_s_per_token, "
                                           "max_output_tokens_per_s required); required unless --script")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (announced on stdout)")
    ap.add_argument("--port-file", help="also write the bound port to this file")
    ap.add_argument("--time-scale", type=float, default=1.0, help="model seconds per wall second")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--kv-capacity-tokens", type=int, default=None)
    ap.add_argument("--script", help="JSON list of canned responses, returned in order")
    ap.add_argument("--crash-after", type=int, default=None, help="exit abruptly after N completion responses")
    ap.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                    help="most prompt + completion tokens of one request")
    ap.add_argument("--gpu-ids", default="", help="comma-separated ids of the emulated GPUs this engine runs on "
                                                "(with --gpu-share-dir: shares them with the node's other engines)")
    ap.add_argument("--gpu-share-dir", default="", help="the node's GPU-sharing directory (one per node); "
                                                      "empty = alone on its GPUs")
    ap.add_argument("--gpu-share-poll-ms", type=float, default=DEFAULT_GPU_SHARE_POLL_S * 1000,
                    help="wall milliseconds between looks at the neighbours' busy marks while busy")
    return ap


def engine_from_args(args: argparse.Namespace) -> EmulatedEngine:
    """Build the engine from parsed flags; raise ValueError naming the bad flag."""
    script = load_script(args.script) if args.script else None
    if args.profile_json:
        profile = profile_from_json(args.profile_json)
    elif script is not None:
        profile = Profile(args.model, 1, 1, 0.0, 0.0, 0.0, 0.001, 1000.0)  # unused in scripted mode
    else:
        raise ValueError("--profile-json: required unless --script is given")
    if args.crash_after is not None and args.crash_after < 1:
        raise ValueError("--crash-after: must be >= 1")
    gpu_ids = [g.strip() for g in args.gpu_ids.split(",") if g.strip()] if args.gpu_ids else []
    if bool(gpu_ids) != bool(args.gpu_share_dir):
        raise ValueError("--gpu-ids and --gpu-share-dir: give both (to share GPUs) or neither")
    if not args.gpu_share_poll_ms > 0:
        raise ValueError(f"--gpu-share-poll-ms: must be > 0, got {args.gpu_share_poll_ms}")
    share = None
    if gpu_ids:
        try:
            share = GpuShare(args.gpu_share_dir, gpu_ids)
        except ValueError as e:
            raise ValueError(f"--gpu-ids: {e}") from None
        except OSError as e:
            raise ValueError(f"--gpu-share-dir: cannot use {args.gpu_share_dir!r}: {e.strerror or e}") from None
    # The key comes in the environment (set by the deployer for this instance only), never on the
    # command line, where any local user could read it.
    return EmulatedEngine(args.model, profile, time_scale=args.time_scale, max_batch=args.max_batch,
                          kv_capacity_tokens=args.kv_capacity_tokens, script=script, crash_after=args.crash_after,
                          max_model_len=args.max_model_len, api_key=os.environ.get(API_KEY_ENV, ""),
                          gpu_share=share, gpu_share_poll_s=args.gpu_share_poll_ms / 1000)


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        engine = engine_from_args(args)
    except ValueError as e:
        ap.error(str(e))  # exit code 2, like any bad flag
    try:
        telemetry.setup_tracing("flowmaker-engine")
    except Exception as e:  # e.g. OTEL_TRACES_EXPORTER=otlp without the exporter: serve untraced
        print(f"warning: tracing off: {e}", file=sys.stderr, flush=True)
    asyncio.run(serve(engine, args.host, args.port, args.port_file, announce=True))


if __name__ == "__main__":
    main()
    sys.exit(0)
