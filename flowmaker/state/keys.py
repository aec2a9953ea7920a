"""Every etcd key FlowMaker reads or writes is built here, and only here (layout: docs/state.md).

Each variable component is percent-encoded, so ids may hold any character
(a "/" in a model id cannot split the hierarchy) and `parse_*` inverts them.
Prefix builders end with "/" so `nodes/a` never matches `nodes/ab`.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from flowmaker.errors import InvalidSpec

ROOT = "/flowmaker/v1/"

NODES = ROOT + "nodes/"
GPUS = ROOT + "gpus/"
INSTANCES = ROOT + "instances/"
TASKS = ROOT + "tasks/"
REUSE = ROOT + "reuse/"
PROFILES = ROOT + "profiles/"
MODELS = ROOT + "models/"
PROFILING_JOBS = ROOT + "profiling-jobs/"
OWNERS = ROOT + "owners/"
INTERFERENCE = ROOT + "interference/"
ORCHESTRATORS = ROOT + "orchestrators/"
TASK_NAMES = ROOT + "task-names/"
# Users and bearer tokens managed live (services/orchestrator/users.py): every orchestrator replica watches them.
USERS = ROOT + "users/"
USER_NAMES = ROOT + "user-names/"
TOKENS = ROOT + "tokens/"
# The elected orchestrator replica (the one that reconciles, deploys and follows the load); bound to its lease.
ORCHESTRATOR_LEADER = ORCHESTRATORS + "leader"


def _c(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidSpec(f"{what} must be a non-empty string, got {value!r}", field=what)
    return quote(value, safe="")


def node(node_id: str) -> str:
    """Liveness + description of one deployer node; bound to the node's lease."""
    return NODES + _c(node_id, "node")


def gpu(node_id: str, gpu_id: str) -> str:
    """One GPU's inventory and memory accounting."""
    return GPUS + _c(node_id, "node") + "/" + _c(gpu_id, "gpu_id")


def gpus_of_node(node_id: str) -> str:
    return GPUS + _c(node_id, "node") + "/"


def instance(instance_id: str) -> str:
    """A model instance: model, tp, pp, node, gpu ids, endpoint, state, load."""
    return INSTANCES + _c(instance_id, "instance_id")


def task(task_id: str) -> str:
    """A task: spec, candidates, approved ids, chosen variant, state."""
    return TASKS + _c(task_id, "task_id")


def orchestrator_replica(replica_id: str) -> str:
    """One orchestrator replica: its address and the load it measured per task; bound to the replica's lease."""
    return ORCHESTRATORS + "replicas/" + _c(replica_id, "replica_id")


def task_name(owner: str, name: str) -> str:
    """A task's name, unique per owner ("" = the anonymous admin of a plaintext stack): value {"task_id"}."""
    return TASK_NAMES + quote(owner or "~", safe="") + "/" + _c(name, "name")


def parse_task_name(key: str) -> tuple[str, str]:
    """(owner, name) of a `task_name` key."""
    owner, name = _tail(key, TASK_NAMES, 2)
    return ("" if owner == "~" else owner), name


def owner(task_id: str) -> str:
    """Who owns a task (the authenticated user that deployed it); only they, or an admin, may touch it."""
    return OWNERS + _c(task_id, "task_id")


def user(user_id: str) -> str:
    """A user created live: {id, name, admin, create_time}; its id ("u-...") is what owns its tasks."""
    return USERS + _c(user_id, "user_id")


def user_name(name: str) -> str:
    """A live user's display name, unique: value {user_id}."""
    return USER_NAMES + _c(name, "name")


def token(digest: str) -> str:
    """A live bearer token, by the SHA-256 hex digest of the token (never the token): {token_id, user_id,
    expire_time, create_time}."""
    return TOKENS + _c(digest, "digest")


def reuse(instance_id: str, task_id: str) -> str:
    """The load one task puts on one instance; the instance is in use while any such key exists."""
    return REUSE + _c(instance_id, "instance_id") + "/" + _c(task_id, "task_id")


def reuse_of_instance(instance_id: str) -> str:
    return REUSE + _c(instance_id, "instance_id") + "/"


def profile(gpu_type: str, model_id: str, tp: int, pp: int, source: str) -> str:
    """A latency/memory profile of one deployable (model, tp, pp) on one GPU type, by source."""
    if tp < 1 or pp < 1:
        raise InvalidSpec(f"tp and pp must be >= 1, got tp={tp} pp={pp}", field="tp")
    return (PROFILES + _c(gpu_type, "gpu_type") + "/" + _c(model_id, "model_id") + f"/{tp}x{pp}/"
            + _c(source, "source"))


def profiles_of_gpu_type(gpu_type: str) -> str:
    return PROFILES + _c(gpu_type, "gpu_type") + "/"


def profiles_of_model(gpu_type: str, model_id: str) -> str:
    """Every profile (all tp x pp, all sources) of one model on one GPU type."""
    return profiles_of_gpu_type(gpu_type) + _c(model_id, "model_id") + "/"


def model(model_id: str) -> str:
    """A model registered with the profiler."""
    return MODELS + _c(model_id, "model_id")


def profiling_job(job_id: str) -> str:
    """One measured-profiling job of the profiler."""
    return PROFILING_JOBS + _c(job_id, "job_id")


def interference(gpu_type: str) -> str:
    """The measured GPU-sharing constant kappa of one GPU type (`flowmaker.state.interference`)."""
    return INTERFERENCE + _c(gpu_type, "gpu_type")


def _tail(key: str, prefix: str, parts: int) -> list[str]:
    if not key.startswith(prefix):
        raise InvalidSpec(f"key {key!r} is not under {prefix!r}", field="key")
    rest = key[len(prefix):].split("/")
    if len(rest) != parts or not all(rest):
        raise InvalidSpec(f"key {key!r} does not have {parts} component(s) under {prefix!r}", field="key")
    return [unquote(p) for p in rest]


def parse_node(key: str) -> str:
    return _tail(key, NODES, 1)[0]


def parse_gpu(key: str) -> tuple[str, str]:
    n, g = _tail(key, GPUS, 2)
    return n, g


def parse_instance(key: str) -> str:
    return _tail(key, INSTANCES, 1)[0]


def parse_task(key: str) -> str:
    return _tail(key, TASKS, 1)[0]


def parse_reuse(key: str) -> tuple[str, str]:
    i, t = _tail(key, REUSE, 2)
    return i, t


def parse_owner(key: str) -> str:
    (t,) = _tail(key, OWNERS, 1)
    return t


def parse_user(key: str) -> str:
    (u,) = _tail(key, USERS, 1)
    return u


def parse_token(key: str) -> str:
    (d,) = _tail(key, TOKENS, 1)
    return d


def parse_profile(key: str) -> tuple[str, str, int, int, str]:
    gpu_type, model_id, shape, source = _tail(key, PROFILES, 4)
    tp, _, pp = shape.partition("x")
    return gpu_type, model_id, int(tp), int(pp), source


def parse_interference(key: str) -> str:
    (g,) = _tail(key, INTERFERENCE, 1)
    return g
