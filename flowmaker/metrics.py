"""Prometheus metrics of every FlowMaker service: one server interceptor for RPC counts and latencies, and the
hooks the services call for reconcile passes, selections and instance load.

Names follow the Prometheus conventions (base units, `_total` on counters, `_seconds` on durations) and
match the Grafana dashboard in `compose/grafana/flowmaker-dashboard.json`:

| metric | labels | what |
|---|---|---|
| `flowmaker_rpc_requests_total` | service, method, code | RPCs handled, by final gRPC status |
| `flowmaker_rpc_duration_seconds` | service, method, code | RPC latency (histogram) |
| `flowmaker_reconcile_duration_seconds` | service | one reconcile pass (histogram) |
| `flowmaker_selection_duration_seconds` | strategy, feasible | one SelectVariant solve (histogram) |
| `flowmaker_instance_load_output_tokens_per_second` | instance, model, node, kind=planned/observed | load |
| `flowmaker_instance_headroom_output_tokens_per_second` | instance, model, node | capacity left |
| `flowmaker_instance_queue_requests` | instance, model, node, state=running/waiting | the engine's queue |
| `flowmaker_leader` | service | 1 while this replica is the elected leader (it reconciles), else 0 |
| `flowmaker_task_requests_total` | task, outcome=ok/error/cancelled | Invoke requests per task (each orchestrator replica counts its own) |
| `flowmaker_task_slo_met_requests_total` | task | requests answered within the task's latency SLO (attainment = this / requests ok+error) |
| `flowmaker_task_latency_seconds` | task | end-to-end latency of a request answered, model seconds (wall seconds on real GPUs) (histogram) |
| `flowmaker_task_tokens_total` | task, kind=prompt/completion | tokens of the task's LLM calls, as the engines counted them |

Each process serves them on `FLOWMAKER_<SVC>_METRICS_PORT` (`flowmaker.settings.ServiceSettings.metrics_port`;
-1 = off, 0 = any free port) at `/metrics`, with the process and Python collectors of prometheus-client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
import grpc.aio
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets from 1 ms (a health check) to 5 min (a deploy that starts engines).
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
               300.0)

RPC_REQUESTS = Counter("flowmaker_rpc_requests", "gRPC requests handled, by service, method and final status code.",
                       ["service", "method", "code"])
RPC_DURATION = Histogram("flowmaker_rpc_duration_seconds", "gRPC request latency by service, method and status code.",
                         ["service", "method", "code"], buckets=RPC_BUCKETS)
RECONCILE_DURATION = Histogram("flowmaker_reconcile_duration_seconds", "Duration of one reconcile pass.",
                               ["service"], buckets=RPC_BUCKETS)
SELECTION_DURATION = Histogram("flowmaker_selection_duration_seconds", "Duration of one variant selection (solver).",
                               ["strategy", "feasible"], buckets=RPC_BUCKETS)
INSTANCE_LOAD = Gauge("flowmaker_instance_load_output_tokens_per_second",
                      "Load on a model instance in output tokens/s: planned (sum of the tasks' reuse loads) or "
                      "observed (measured from the engine).", ["instance", "model", "node", "kind"])
INSTANCE_HEADROOM = Gauge("flowmaker_instance_headroom_output_tokens_per_second",
                          "Output tokens/s a model instance can still take: capacity minus max(planned, observed).",
                          ["instance", "model", "node"])
INSTANCE_QUEUE = Gauge("flowmaker_instance_queue_requests", "Requests in the engine: running or waiting.",
                       ["instance", "model", "node", "state"])

TASK_REQUESTS = Counter("flowmaker_task_requests", "Invoke requests per task, by outcome (ok, error, cancelled).",
                        ["task", "outcome"])
TASK_SLO_MET = Counter("flowmaker_task_slo_met_requests", "Requests answered within the task's latency SLO.", ["task"])
TASK_LATENCY = Histogram("flowmaker_task_latency_seconds", "End-to-end latency of a request answered, model seconds.",
                         ["task"], buckets=RPC_BUCKETS)
TASK_TOKENS = Counter("flowmaker_task_tokens", "Tokens of a task's LLM calls (prompt, completion).", ["task", "kind"])
LEADER = Gauge("flowmaker_leader", "1 while this process is its service's elected leader, else 0.", ["service"])


def set_leader(service: str, leading: bool) -> None:
    LEADER.labels(service).set(1 if leading else 0)


def serve_metrics(port: int, host: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY) -> int:
    """Serve /metrics on `port` (0 = any free port) in a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


# ---- the server interceptor ----------------------------------------------------------------------

def _method(full: str) -> str:
    """"/flowmaker.deployer.v1.DeployerService/Deploy" -> "DeployerService/Deploy" (short, still unique)."""
    svc, _, m = full.rpartition("/")
    return f"{svc.rsplit('.', 1)[-1]}/{m}" if svc else full


def _code(context: Any, exc: BaseException | None) -> str:
    """The status the caller gets: what the handler (or the error interceptor inside) set, else from the outcome."""
    code = None
    with contextlib.suppress(Exception):
        code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpc versions keep the raw number
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    if exc is None:
        return "OK"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return str(exc.code().name)
    return "CANCELLED" if isinstance(exc, BaseException) and type(exc).__name__ == "CancelledError" else "UNKNOWN"


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every RPC by method and final status. Put it outermost (before the error interceptor)
    so it sees the status the caller receives."""

    def __init__(self, service: str) -> None:
        self.service = service

    def _record(self, method: str, code: str, t0: float) -> None:
        RPC_REQUESTS.labels(self.service, method, code).inc()
        RPC_DURATION.labels(self.service, method, code).observe(time.perf_counter() - t0)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = _method(handler_call_details.method)
        rec = self._record

        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: Any) -> Any:
                t0 = time.perf_counter()
                exc: BaseException | None = None
                try:
                    return await inner(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    rec(method, _code(context, exc), t0)

            factory = grpc.unary_unary_rpc_method_handler if handler.unary_unary else \
                grpc.stream_unary_rpc_method_handler
            return factory(unary, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def streaming(request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            exc: BaseException | None = None
            try:
                res = inner_stream(request, context)
                if hasattr(res, "__aiter__"):
                    async for item in res:
                        yield item
                else:  # a handler that writes with context.write() and returns None
                    await res
            except BaseException as e:
                exc = e
                raise
            finally:
                rec(method, _code(context, exc), t0)

        factory = grpc.unary_stream_rpc_method_handler if handler.unary_stream else \
            grpc.stream_stream_rpc_method_handler
        return factory(streaming, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


# ---- hooks ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def time_reconcile(service: str = "orchestrator") -> Iterator[None]:
    """`with time_reconcile(): ...` around one reconcile pass."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        RECONCILE_DURATION.labels(service).observe(time.perf_counter() - t0)


def observe_selection(strategy: str, feasible: bool, elapsed_s: float) -> None:
    """One selection, with the solver's own elapsed time."""
    SELECTION_DURATION.labels(strategy, "true" if feasible else "false").observe(max(0.0, elapsed_s))


def observe_task_request(task_id: str, outcome: str, *, latency_s: float = 0.0, slo_s: float = 0.0,
                         prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
    """One Invoke of a task: its outcome and, when answered, its latency (model seconds) against the latency SLO
    `slo_s`, and its tokens."""
    TASK_REQUESTS.labels(task_id, outcome).inc()
    if outcome != "ok":
        return
    TASK_LATENCY.labels(task_id).observe(max(0.0, latency_s))
    if latency_s <= slo_s:
        TASK_SLO_MET.labels(task_id).inc()
    TASK_TOKENS.labels(task_id, "prompt").inc(prompt_tokens)
    TASK_TOKENS.labels(task_id, "completion").inc(completion_tokens)


def forget_task(task_id: str) -> None:
    """Drop a deleted task's series (their label values would otherwise stay for the life of the process)."""
    for metric, extra in ((TASK_REQUESTS, ("ok", "error", "cancelled")), (TASK_TOKENS, ("prompt", "completion"))):
        for x in extra:
            with contextlib.suppress(KeyError):
                metric.remove(task_id, x)
    for single in (TASK_SLO_MET, TASK_LATENCY):
        with contextlib.suppress(KeyError):
            single.remove(task_id)


def set_instance_load(records: Iterable[Any], *, capacity: Callable[[Any], float | None] = lambda r: None,
                      queue: Callable[[Any], tuple[float, float] | None] = lambda r: None) -> None:
    """Replace the instance gauges with `records` (InstanceRecord-like: id, model_id, node,
    load_output_tokens_per_s, observed_load_output_tokens_per_s); `capacity(r)` gives the instance's output
    tokens/s capacity for the headroom, `queue(r)` its (running, waiting) requests, when known."""
    for g in (INSTANCE_LOAD, INSTANCE_HEADROOM, INSTANCE_QUEUE):
        g.clear()  # instances that are gone must not linger as stale series
    for r in records:
        planned = float(r.load_output_tokens_per_s)
        observed = float(getattr(r, "observed_load_output_tokens_per_s", 0.0))
        INSTANCE_LOAD.labels(r.id, r.model_id, r.node, "planned").set(planned)
        INSTANCE_LOAD.labels(r.id, r.model_id, r.node, "observed").set(observed)
        cap = capacity(r)
        if cap is not None:
            INSTANCE_HEADROOM.labels(r.id, r.model_id, r.node).set(cap - max(planned, observed))
        q = queue(r)
        if q is not None:
            INSTANCE_QUEUE.labels(r.id, r.model_id, r.node, "running").set(q[0])
            INSTANCE_QUEUE.labels(r.id, r.model_id, r.node, "waiting").set(q[1])
