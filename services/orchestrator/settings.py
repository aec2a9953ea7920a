"""Settings of the orchestrator service (env prefix FLOWMAKER_ORCHESTRATOR_)."""

from __future__ import annotations

from pydantic import Field

from flowmaker.settings import DEFAULT_PORTS, ServiceSettings, settings_config


class OrchestratorSettings(ServiceSettings):
    """Everything `python -m services.orchestrator` reads from the environment."""

    model_config = settings_config("orchestrator")

    port: int = Field(default=DEFAULT_PORTS["orchestrator"], ge=0, le=65535, description="gRPC port; 0 = any free port.")
    selector_address: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['selector']}",
                                  description="host:port of the selector service.")
    generator_address: str = Field(default="", description="host:port of the generator service; empty = the built-in "
                                                   "template library, in process.")
    max_workflows: int = Field(default=3, ge=1, le=20, description="Candidates asked of the generator when the request "
                                                           "says 0.")
    default_strategy: str = Field(default="exact", description="Selection strategy when ApproveWorkflows names none.")
    commit_retries: int = Field(default=5, ge=1, le=100, description="Select-and-commit attempts when the cluster changed "
                                                             "between selection and commit.")
    select_timeout_s: float = Field(default=60.0, gt=0, description="Deadline of one SelectVariant call.")
    deploy_timeout_s: float = Field(default=300.0, gt=0, description="Deadline of one Deploy call (engine start included).")
    release_timeout_s: float = Field(default=60.0, gt=0, description="Deadline of one Release call.")
    invoke_timeout_s: float = Field(default=300.0, gt=0, description="Deadline of an Invoke when the client sets none; "
                                                             "each engine call gets what is left.")
    tool_time_scale: float = Field(default=1.0, gt=0, description="TOOL stages sleep latency_s / this (emulated tools; "
                                                          "set like the engines' time scale).")
    http_pool_size: int = Field(default=100, ge=1, description="Connections of the pooled HTTP session to the engines.")
    latency_window: int = Field(default=200, ge=1, description="Invoke latencies kept per task for the p50/p95 in GetTask.")
