"""HTTP client of the engines: OpenAI-compatible /v1/chat/completions over one pooled aiohttp session.

A request's sampling parameters (`InvokeRequest.sampling`) reach every engine call made for it through the
context variable `request_sampling`, which the servicer sets per RPC: the invoke path between them (routing,
retries, replicas) carries them without knowing about them."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from flowmaker import telemetry
from flowmaker.errors import DeadlineExceeded, InvalidSpec, Unavailable
from flowmaker.redact import scrub
from flowmaker.sampling import Sampling

log = logging.getLogger(__name__)

OnDelta = Callable[[str], Awaitable[None]]

# The sampling parameters of the request being served (None: the engines' defaults); set by the servicer, read
# by `EngineClient.chat` unless a call passes its own.
request_sampling: ContextVar[Sampling | None] = ContextVar("request_sampling", default=None)


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    model: str = ""  # the model the engine says answered ("" when it did not say)
    finish_reason: str = ""


class EngineClient:
    """One connection pool for every engine (created lazily inside the running loop). Each call is a
    `chat <model>` CLIENT span (gen_ai.* attributes) whose HTTP request carries the W3C trace context.
    `trace_configs` are aiohttp's request hooks (tests use one to read the headers that went out)."""

    def __init__(self, pool_size: int = 100, *, trace_configs: Sequence[aiohttp.TraceConfig] = ()) -> None:
        self.pool_size = pool_size
        self.trace_configs = list(trace_configs)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.pool_size),
                                                  trace_configs=self.trace_configs or None)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def alive(self, endpoint: str, timeout_s: float = 1.0) -> bool:
        """Whether the engine at `endpoint` answers GET /health with 200 within `timeout_s` (the health path of
        vLLM, trtllm-serve and the emulated engine alike; it needs no API key)."""
        try:
            async with self._http().get(endpoint.rstrip("/") + "/health",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def chat(self, endpoint: str, model: str, prompt: str, max_tokens: int, *, timeout_s: float,
                   instance_id: str = "", on_delta: OnDelta | None = None, api_key: str = "",
                   sampling: Sampling | None = None) -> Completion:
        """One chat completion. `timeout_s` is what is left of the request's deadline; `on_delta`
        (streaming) gets each text piece as the engine produces it; `api_key` is the instance's key
        (sent as a bearer token; engines started with one refuse calls without it); `sampling`: the
        request's parameters (default: `request_sampling`'s)."""
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens}
        sampling = sampling if sampling is not None else request_sampling.get()
        if sampling is not None:
            body.update(sampling.body())
        if on_delta is not None:
            # include_usage: the final chunk carries `usage` (vLLM, SGLang, TRT-LLM), so the span's token
            # counts are the engine's, not a word count.
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        url = endpoint.rstrip("/") + "/v1/chat/completions"
        what = f"instance {instance_id or endpoint} ({model})"
        attrs = {telemetry.FLOWMAKER_INSTANCE: instance_id} if instance_id else {}
        attrs.update(telemetry.sampling_attributes(body))
        with telemetry.llm_span(model, max_tokens=max_tokens, server_address=urlsplit(url).hostname,
                                attributes=attrs) as span:
            # Injected inside the span: the engine's own spans (vLLM --otlp-traces-endpoint) hang under it.
            headers = telemetry.inject_http_headers()
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
            try:
                async with self._http().post(url, json=body, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    if r.status != 200:
                        # Scrubbed: an engine may echo the request, its Authorization header included.
                        detail = scrub((await r.text())[:2000], [api_key])[:500]
                        if r.status == 400:
                            # The call itself was refused (e.g. prompt + max_tokens beyond the model's context,
                            # by the engine's own token count): retrying cannot help.
                            raise InvalidSpec(f"{what} refused the call: {detail}", field="input",
                                              reason="ENGINE_REJECTED",
                                              metadata={"instance_id": instance_id, "status": "400"})
                        raise Unavailable(f"{what} answered HTTP {r.status}: {detail}", reason="ENGINE_ERROR",
                                          metadata={"instance_id": instance_id, "status": str(r.status)})
                    if on_delta is None:
                        c = self._parse(await r.json())
                    else:
                        c = await self._read_stream(r, on_delta)
            except TimeoutError:
                raise DeadlineExceeded(f"{what} did not answer within {timeout_s:.3g}s (the request's deadline)",
                                       metadata={"instance_id": instance_id}) from None
            except aiohttp.ClientError as e:
                raise Unavailable(f"{what} unreachable at {endpoint}: {e}", reason="ENGINE_UNREACHABLE",
                                  metadata={"instance_id": instance_id}) from None
            telemetry.record_llm_usage(span, input_tokens=c.prompt_tokens, output_tokens=c.completion_tokens,
                                       response_model=c.model, finish_reasons=[c.finish_reason] if c.finish_reason
                                       else [])
            return c

    @staticmethod
    def _parse(data: dict[str, Any]) -> Completion:
        choice = data["choices"][0]
        text = choice["message"].get("content") or ""
        usage = data.get("usage") or {}
        return Completion(text, int(usage.get("prompt_tokens", 0)),
                          int(usage.get("completion_tokens", len(text.split()))),
                          str(data.get("model") or ""), str(choice.get("finish_reason") or ""))

    @staticmethod
    async def _read_stream(r: aiohttp.ClientResponse, on_delta: OnDelta) -> Completion:
        parts: list[str] = []
        usage: dict[str, Any] = {}
        model = finish = ""
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                continue
            usage = chunk.get("usage") or usage
            model = chunk.get("model") or model
            for ch in chunk.get("choices") or ():
                finish = ch.get("finish_reason") or finish
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    parts.append(piece)
                    await on_delta(piece)
        text = "".join(parts)
        return Completion(text, int(usage.get("prompt_tokens", 0)),
                          int(usage.get("completion_tokens", len(text.split()))), str(model), str(finish))
