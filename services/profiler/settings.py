"""Settings of the profiler service (env prefix FLOWMAKER_PROFILER_): where engines for measured sweeps come from."""

from __future__ import annotations

from pydantic import Field

from flowmaker.settings import DEFAULT_PORTS, ServiceSettings, settings_config


class ProfilerSettings(ServiceSettings):
    """Everything `python -m services.profiler` reads from the environment."""

    model_config = settings_config("profiler")

    port: int = Field(default=DEFAULT_PORTS["profiler"], ge=0, le=65535, description="gRPC port; 0 = any free port.")
    deployer_address: str = Field(default="", description="Deployer gRPC address (host:port) that starts the engines of a "
                                                  "measured sweep; empty = start them on this host (engine_backend).")
    deployer_tls_server_name: str = Field(default="", description="With TLS: the name the deployer's certificate is "
                                          "checked against instead of the host of deployer_address; empty = "
                                          "that host.")
    engine_backend: str = Field(default="emulated", description="Backend of locally started engines when no deployer is "
                                                        "configured: emulated, vllm or trtllm; empty = refuse "
                                                        "ProfileModel (FAILED_PRECONDITION).")
    engine_time_scale: float = Field(default=1.0, gt=0, description="Time scale of emulated engines (local, or the deployer's "
                                                            "FLOWMAKER_DEPLOYER_ENGINE_TIME_SCALE); measurements "
                                                            "are scaled back by it.")
    gpu_type: str = Field(default="A6000", description="GPU type of GetProfiles/ProfileModel when the request names none "
                                               "and no deployer node is registered in etcd.")
    gpus_per_node: int = Field(default=8, ge=1, le=64, description="Largest tp*pp considered when no node is registered.")
    analytic_gpu_types: str = Field(default="", description="Comma-separated GPU types whose analytic profiles are stored at "
                                                    "registration; empty = every catalogued type.")
    preload_catalog: bool = Field(default=True, description="Register the built-in catalog's models at start (idempotent).")
    sweep_repeats: int = Field(default=5, ge=1, description="Times each single-request point of a sweep is sent.")
    sweep_input_tokens: str = Field(default="32,512,2048", description="Comma-separated prompt lengths of the single-request "
                                                               "sweep.")
    sweep_output_tokens: str = Field(default="8,64,256", description="Comma-separated output lengths of the single-request "
                                                             "sweep.")
    throughput_output_tokens: int = Field(default=256, ge=1, description="Output length of the throughput sweep's requests.")
    max_concurrency: int = Field(default=128, ge=1, description="Largest number of concurrent clients of the throughput sweep.")
