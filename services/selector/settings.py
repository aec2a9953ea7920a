"""Settings of the selector service (env prefix FLOWMAKER_SELECTOR_)."""

from __future__ import annotations

from pydantic import Field

from flowmaker.settings import DEFAULT_PORTS, ServiceSettings, settings_config


class SelectorSettings(ServiceSettings):
    """Everything `python -m services.selector` reads from the environment."""

    model_config = settings_config("selector")

    port: int = Field(default=DEFAULT_PORTS["selector"], ge=0, le=65535, description="gRPC port; 0 = any free port.")
    default_gpu_type: str = Field(default="A6000", description="GPU type for analytic profiles when the cluster's GPUs "
                                                       "do not say (catalog name).")
    max_gpus_per_instance: int = Field(default=8, ge=1, le=64, description="Largest tp*pp for which analytic profiles "
                                                                    "are generated when the request has none.")
    live_state: bool = Field(default=True, description="Read a missing cluster / missing profiles from etcd; when false "
                                               "such requests use an empty cluster and analytic profiles.")
