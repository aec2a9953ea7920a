"""Settings of the orchestrator service (env prefix FLOWMAKER_ORCHESTRATOR_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowmaker.settings import DEFAULT_PORTS, ServiceSettings, settings_config


class OrchestratorSettings(ServiceSettings):
    """Everything `python -m services.orchestrator` reads from the environment."""

    model_config = settings_config("orchestrator")

    port: int = Field(default=DEFAULT_PORTS["orchestrator"], ge=0, le=65535, description="gRPC port; 0 = any free port.")
    selector_address: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['selector']}",
                                  description="host:port of the selector service.")
    profiler_address: str = Field(default="", description="host:port of the profiler service: the models registered "
                                  "there are offered to the selector beside the catalog's; empty = the catalog only.")
    generator_address: str = Field(default="", description="host:port of the generator service; empty = the built-in "
                                                   "template library, in process.")
    deployer_tls_server_name: str = Field(default="", description="With TLS: the name the deployers' certificates "
                                          "are checked against instead of the host of their advertised address "
                                          "(Kubernetes: `deployer`, as they advertise their pod IPs); empty = "
                                          "that host.")
    max_workflows: int = Field(default=3, ge=1, le=20, description="Candidates asked of the generator when the request "
                                                           "says 0.")
    default_strategy: str = Field(default="exact", description="Selection strategy when ApproveWorkflows names none.")
    # What a selection plans with when the approval's SelectionOptions leave it unset (docs/selection-spec.md);
    # explicit options win (GPU_SHARING_IGNORE + CAPACITY_MODEL_OUTPUT_TOKENS is the paper's base contract).
    default_capacity_model: Literal["OUTPUT_TOKENS", "BUSY_TIME"] = Field(
        default="BUSY_TIME", description="options.capacity_model when unset: BUSY_TIME counts an instance's "
        "capacity in busy time at each workflow's mean request; OUTPUT_TOKENS is the base contract.")
    default_gpu_sharing: Literal["IGNORE", "INTERFERENCE"] = Field(
        default="INTERFERENCE", description="options.gpu_sharing when unset: INTERFERENCE plans with co-residents "
        "slowing each other (measured busy shares, co-residents' tolerated slowdown); IGNORE is the base contract.")
    default_utilization_cap: float = Field(
        default=0.85, gt=0, le=1.0, description="options.utilization_cap (u) when unset: an instance is planned busy "
        "at most this share of its time. The spec's default, 1, plans mean latencies within the SLO whose p95 is not "
        "(an instance 96% busy); the headroom keeps the tail within it.")
    default_interference: float = Field(
        default=-1.0, ge=-1.0, le=4.0, description="options.interference (kappa) when unset, under INTERFERENCE; "
        "negative = the kappa the profiler stored for the cluster's GPU type (flowmaker profiles "
        "measure-interference), 1 (full processor sharing) when none is stored.")
    default_gpu_price_gb: float = Field(
        default=-1.0, ge=-1.0, le=10_000.0, description="options.gpu_price_gb when unset (docs/selection-spec.md, "
        "priced GPUs): each GPU a new instance spans costs this many GB more in the objective, for the compute it "
        "takes. Negative = the memory of one of the cluster's GPUs (the largest), so a GPU spanned is charged as if "
        "its whole memory were taken; 0 = the base contract (memory only).")
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
    observe_flush_interval_s: float = Field(default=1.0, gt=0, description="Invoke latencies are batched and written "
                                            "to their task records this often (never on a request's path).")
    invoke_heal_wait_s: float = Field(default=30.0, ge=0, description="How long an Invoke whose instance died waits "
                                      "(within its deadline) for the replacement before failing; 0 = fail at once.")
    # The reconciler (flowmaker.orchestration.reconcile): desired state vs what runs.
    reconcile_heal: bool = Field(default=True, description="Carry out the reconciler's actions (restart, "
                                 "re-select, resume, release leaks); false = observe only (routing cache).")
    reconcile_interval_s: float = Field(default=2.0, gt=0, description="Periodic resync, besides etcd watches.")
    reconcile_restart_backoff_s: float = Field(default=1.0, ge=0, description="Wait before the 2nd restart in place "
                                               "of a failed instance; doubles for each further one.")
    reconcile_max_restarts: int = Field(default=3, ge=0, description="Restarts in place within the window before "
                                        "the tasks using the instance are re-selected.")
    reconcile_restart_window_s: float = Field(default=300.0, gt=0, description="Window of reconcile_max_restarts.")
    reconcile_node_lost_grace_s: float = Field(default=10.0, ge=0, description="A node whose lease expired is "
                                               "LOST after this much longer (its tasks are then re-selected).")
    reconcile_orphan_grace_s: float = Field(default=30.0, ge=0, description="An instance no task references, or a "
                                            "reference to a task that does not exist, is released after this long.")
    reconcile_deploying_deadline_s: float = Field(default=600.0, gt=0, description="A task DEPLOYING this long "
                                                  "(since its last update) is rolled back.")
    reconcile_heal_backoff_max_s: float = Field(default=10.0, gt=0, description="Longest wait between two "
                                                "re-selection attempts of a task waiting for capacity.")
    # Following the load (flowmaker.orchestration.adapt): re-select a task whose observed rate leaves its plan.
    follow_load: bool = Field(default=True, description="Re-select (make-before-break) a task whose observed "
                              "arrival rate or latency leaves its plan for longer than load_hold_down_s.")
    load_window_s: float = Field(default=20.0, gt=0, description="Window (wall s) of the per-task observed rate "
                                 "and latency quantile.")
    load_band: float = Field(default=2.0, gt=1, description="Re-select when observed > band x planned rate, or < "
                             "planned / band.")
    load_hold_down_s: float = Field(default=30.0, ge=0, description="The drift must last this long (wall s), and "
                                    "two re-selections of a task are at least this far apart; keep it >= "
                                    "load_window_s, so the rate planned for is all new regime.")
    load_max_replicas: int = Field(default=4, ge=1, le=16, description="A re-selection for load may scale a stage "
                                   "out to this many replicas (selection's max_replicas; docs/selection-spec.md), "
                                   "unless the task's own options ask for more.")
    # Replicas (docs/orchestrator.md#replicas): every replica serves every RPC; one, elected, acts.
    leader_election: bool = Field(default=True, description="Stand for election (an etcd lease on the leader "
                                  "key) and run the reconciler, the lifecycle workers and the load follower only "
                                  "while elected; false = always act (a single replica, as before).")
    leader_lease_ttl_s: int = Field(default=5, ge=3, le=60, description="A new leader takes over within this long "
                                    "after the leader dies (its etcd lease is granted for a second less, refreshed "
                                    "every third of that).")
    replica_id: str = Field(default="", description="This replica's name in the leader key and its replica "
                            "record; empty = host name and process id.")
    advertise_address: str = Field(default="", description="host:port this replica is reached at, shown as the "
                                   "leader's address; empty = the gRPC host:port it listens on.")
    cache_resync_s: float = Field(default=10.0, gt=0, description="Full re-listing of the routing cache (tasks, "
                                  "instances, nodes, owners), besides its etcd watches.")
    max_tasks_per_user: int = Field(default=100, ge=0, description="Tasks one user (a non-admin principal) may "
                                    "own at once; DeployTask beyond it is RESOURCE_EXHAUSTED. 0 = no limit.")
    token_prune_interval_s: float = Field(default=300.0, ge=0, description="How often the leader deletes live "
                                          "tokens that expired more than token_prune_grace_s ago; 0 = never.")
    token_prune_grace_s: float = Field(default=3600.0, ge=0, description="An expired token stays this long (listed "
                                       "as expired by `flowmaker user list`) before it is pruned.")
    drain_timeout_s: float = Field(default=30.0, ge=0, description="After a switch, how long requests already on "
                                   "the old instances may take before their references are released.")
