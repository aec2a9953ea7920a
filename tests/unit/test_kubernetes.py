"""deploy/kubernetes checked without a cluster: the example overlay (mTLS, the default) and the insecure one
(plaintext for debugging) rendered (tests/unit/k8s_render.py, the kustomize features they use), every object validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, offline, strict), and every command, FLOWMAKER_* variable, port, probe, Secret and
ConfigMap it names checked against the code and the other manifests, as test_compose.py does for compose/."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic_settings import BaseSettings

from flowmaker.rpc.tls import IDENTITIES
from flowmaker.settings import DEFAULT_PORTS

k8s_render = pytest.importorskip("k8s_render")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
SERVICES = ("generator", "profiler", "selector", "deployer", "orchestrator")
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target (gRPC probes are GA since 1.27)
OTEL_VARS = {"OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_PROPAGATORS", "OTEL_RESOURCE_ATTRIBUTES"}
OTHER_VARS = {"HF_HOME", "HF_TOKEN", "POD_NAME"}  # read by huggingface_hub (vLLM) / used in etcd's args


TLS_DIR = "/etc/flowmaker/tls"


@pytest.fixture(scope="module", params=["example", "insecure"])
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each overlay, rendered: `example` (mTLS, the default) and `insecure` (plaintext for debugging)."""
    return k8s_render.render(K8S / "overlays" / request.param)


@pytest.fixture(scope="module")
def secure_docs() -> list[dict[str, Any]]:
    return k8s_render.render(K8S / "overlays" / "example")


@pytest.fixture(scope="module")
def insecure_docs() -> list[dict[str, Any]]:
    return k8s_render.render(K8S / "overlays" / "insecure")


def is_secure(docs: list[dict[str, Any]]) -> bool:
    return "--client-cert-auth" in pod_spec(by_kind(docs, "StatefulSet")["etcd"])["containers"][0]["args"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(d: dict[str, Any]) -> dict[str, Any]:
    return d["spec"]["template"]["spec"]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def settings_fields(service: str) -> set[str]:
    mod = importlib.import_module(f"services.{service}.settings")
    prefix = f"FLOWMAKER_{service.upper()}_"
    classes = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, BaseSettings)
               and c.model_config.get("env_prefix") == prefix]
    assert classes, f"services/{service}/settings.py has no settings class with env prefix {prefix}"
    return {name for c in classes for name in c.model_fields}


def test_every_object_validates_against_the_kubernetes_schema(docs: list[dict[str, Any]]) -> None:
    assert len(docs) > 20
    errors = []
    for d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {e.message}")
    assert not errors, "\n".join(errors)


def test_validation_catches_a_mistake(docs: list[dict[str, Any]]) -> None:
    bad = json.loads(json.dumps(by_kind(docs, "Deployment")["orchestrator"]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = bad["spec"]["template"]["spec"][
        "containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_shape_the_issue_asks_for(docs: list[dict[str, Any]]) -> None:
    sts = by_kind(docs, "StatefulSet")["etcd"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "etcd"
    assert by_kind(docs, "Service")["etcd"]["spec"]["clusterIP"] == "None"  # stable member names
    deployments = by_kind(docs, "Deployment")
    ds = by_kind(docs, "DaemonSet")["deployer"]
    for svc in SERVICES:
        c = pod_spec(ds if svc == "deployer" else deployments[svc])["containers"][0]
        port = DEFAULT_PORTS[svc]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if is_secure(docs):  # Kubernetes' gRPC probes speak plaintext only
                cmd = c[probe]["exec"]["command"]
                assert cmd[:3] == ["grpc_health_probe", f"-addr=localhost:{port}", "-tls"], f"{svc}: {probe}"
                assert "grpc" not in c[probe]
            else:
                assert c[probe]["grpc"]["port"] == port, f"{svc}: {probe} is not gRPC health on {port}"
                assert "exec" not in c[probe]
    spec = pod_spec(ds)
    c = spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    env = {e["name"]: e for e in c["env"]}
    assert env["FLOWMAKER_DEPLOYER_USE_NVML"]["value"] == "true"
    assert env["FLOWMAKER_DEPLOYER_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for name in (*SERVICES, "gateway", "etcd", "otel-collector"):
        assert name in by_kind(docs, "Service"), f"no Service {name}"
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert pdbs["etcd"]["spec"]["minAvailable"] == 2
    assert {"orchestrator", "selector", "generator", "profiler", "gateway"} <= set(pdbs)
    nps = by_kind(docs, "NetworkPolicy")
    assert nps["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": []}
    assert {"flowmaker-tls", "flowmaker-auth", "flowmaker-llm", "flowmaker-hf"} <= set(by_kind(docs, "Secret"))
    assert "otel-collector" in deployments
    dash = by_kind(docs, "ConfigMap")["flowmaker-grafana-dashboard"]
    assert json.loads(dash["data"]["flowmaker-dashboard.json"])["uid"] == "flowmaker"


def test_commands_env_vars_and_ports_exist_in_the_code(docs: list[dict[str, Any]]) -> None:
    otel = by_kind(docs, "ConfigMap")["flowmaker-otel"]["data"]
    assert set(otel) <= OTEL_VARS
    for d in workloads(docs):
        for c in pod_spec(d)["containers"]:
            cmd = c.get("command", [])
            if cmd[:2] == ["python", "-m"]:
                assert importlib.util.find_spec(cmd[2] + ".__main__") is not None, f"{d['metadata']['name']}: {cmd}"
            env = {e["name"]: e for e in c.get("env", [])}
            for var in env:
                if var.startswith("OTEL_"):
                    assert var in OTEL_VARS, f"{c['name']}: unknown OpenTelemetry variable {var}"
                elif var.startswith("FLOWMAKER_"):
                    m = re.fullmatch(r"FLOWMAKER_([A-Z]+)_([A-Z0-9_]+)", var)
                    assert m, var
                    svc, field = m.group(1).lower(), m.group(2).lower()
                    assert svc == c["name"], f"{c['name']}: {var} is another service's setting"
                    assert field in settings_fields(svc), f"{c['name']}: {var}: no field {field!r}"
                else:
                    assert var in OTHER_VARS, f"{c['name']}: unexpected variable {var}"
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            if c["name"] in SERVICES:
                bound = int(env[f"FLOWMAKER_{c['name'].upper()}_PORT"]["value"])
                assert bound == DEFAULT_PORTS[c["name"]] == ports["grpc"], c["name"]
                assert int(env[f"FLOWMAKER_{c['name'].upper()}_METRICS_PORT"]["value"]) == ports["metrics"]
                assert env[f"FLOWMAKER_{c['name'].upper()}_HOST"]["value"] == "0.0.0.0"
            if c["name"] == "gateway":
                assert int(env["FLOWMAKER_GATEWAY_PORT"]["value"]) == ports["http"]
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_addresses_and_etcd_endpoints_name_real_services(docs: list[dict[str, Any]]) -> None:
    services = by_kind(docs, "Service")
    replicas = by_kind(docs, "StatefulSet")["etcd"]["spec"]["replicas"]
    for d in workloads(docs):
        for c in pod_spec(d)["containers"]:
            for e in c.get("env", []):
                v = e.get("value", "")
                if e["name"].endswith("_ADDRESS") and v:
                    host, _, port = v.rpartition(":")
                    assert host in services, f"{c['name']}: {e['name']}={v}"
                    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], v
                if e["name"].endswith("_ETCD_ENDPOINTS"):
                    assert v.split(",") == [f"etcd-{i}.etcd:2379" for i in range(replicas)], v


def test_selectors_ports_and_references_resolve(docs: list[dict[str, Any]]) -> None:
    pods = {d["metadata"]["name"]: d for d in workloads(docs)}
    config_maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    accounts = by_kind(docs, "ServiceAccount")
    for s in by_kind(docs, "Service").values():
        sel = s["spec"]["selector"]
        targets = [d for d in pods.values() if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert targets, f"Service {s['metadata']['name']} selects no pods"
        names = {p["name"] for d in targets for c in pod_spec(d)["containers"] for p in c.get("ports", [])}
        for p in s["spec"]["ports"]:
            tp = p.get("targetPort", p["name"])
            assert tp in names or isinstance(tp, int), f"Service {s['metadata']['name']}: no port {tp}"
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= d["spec"]["template"]["metadata"]["labels"].items() for d in pods.values())
    for d in pods.values():
        spec = pod_spec(d)
        assert spec.get("serviceAccountName", "flowmaker") in accounts or "serviceAccountName" not in spec
        for v in spec.get("volumes", []):
            if "secret" in v and not v["secret"].get("optional"):
                assert v["secret"]["secretName"] in secrets, v
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps, v
        for c in spec["containers"]:
            for ef in c.get("envFrom", []):
                assert ef["configMapRef"]["name"] in config_maps
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]]["stringData"], ref
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])} | {
                t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}, c["name"]


def _tls_volume(spec: dict[str, Any], container: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The flowmaker-tls secret volume of a pod and the files it mounts at TLS_DIR in `container`."""
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR]
    assert mount.get("readOnly") is True
    [vol] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["secret"]["secretName"] == "flowmaker-tls"
    items = vol["secret"]["items"]
    assert all(i["key"] == i["path"] for i in items)
    return vol["secret"], {f"{TLS_DIR}/{i['path']}" for i in items}


def test_mtls_is_the_default(secure_docs: list[dict[str, Any]]) -> None:
    """The example overlay (the base) runs every gRPC service, the gateway's channel and etcd on mTLS, with the
    files `python -m flowmaker.rpc.tls` creates, as compose/ and `flowmaker up` do."""
    pki_files = {"ca.pem", *(f"{i}.{ext}" for i in IDENTITIES for ext in ("pem", "key"))}
    pods = {d["metadata"]["name"]: d for d in workloads(secure_docs)}
    for svc in SERVICES:
        spec = pod_spec(pods[svc])
        [c] = spec["containers"]
        secret, files = _tls_volume(spec, c)
        assert not secret.get("optional"), f"{svc}: the flowmaker-tls Secret must be required"
        assert {f.rsplit("/", 1)[1] for f in files} == {"ca.pem", f"{svc}.pem", f"{svc}.key"}, svc  # no ca.key
        env = {e["name"]: e.get("value") for e in c["env"]}
        pre = f"FLOWMAKER_{svc.upper()}_"
        mine = (f"{TLS_DIR}/ca.pem", f"{TLS_DIR}/{svc}.pem", f"{TLS_DIR}/{svc}.key")
        assert (env[pre + "TLS_CA_FILE"], env[pre + "TLS_CERT_FILE"], env[pre + "TLS_KEY_FILE"]) == mine, svc
        assert set(mine) <= files
        assert env[pre + "ETCD_TLS"] == "true", svc
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            cmd = c[probe]["exec"]["command"]
            assert cmd[3:] == [f"-tls-ca-cert={mine[0]}", f"-tls-client-cert={mine[1]}",
                               f"-tls-client-key={mine[2]}"], f"{svc}: {probe}"
            assert c[probe]["timeoutSeconds"] >= 3
    # The deployer is dialled at its pod IP (advertise_host = status.podIP): its callers check the name
    # `deployer`, which its certificate carries (ensure_pki: SAN = the identity).
    deployer_env = {e["name"]: e for e in pod_spec(pods["deployer"])["containers"][0]["env"]}
    assert deployer_env["FLOWMAKER_DEPLOYER_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for svc in ("orchestrator", "profiler"):
        env = {e["name"]: e.get("value") for e in pod_spec(pods[svc])["containers"][0]["env"]}
        assert env[f"FLOWMAKER_{svc.upper()}_DEPLOYER_TLS_SERVER_NAME"] == "deployer", svc
    gw = pod_spec(pods["gateway"])
    _, files = _tls_volume(gw, gw["containers"][0])
    assert files == {f"{TLS_DIR}/ca.pem"}
    assert {e["name"]: e.get("value") for e in gw["containers"][0]["env"]}["FLOWMAKER_GATEWAY_TLS_CA_FILE"] == \
        f"{TLS_DIR}/ca.pem"
    etcd = pod_spec(pods["etcd"])
    secret, files = _tls_volume(etcd, etcd["containers"][0])
    assert not secret.get("optional")
    args = etcd["containers"][0]["args"]
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in args)
    for flag in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                 "--initial-advertise-peer-urls"):
        assert flags[flag].startswith("https://"), flag
    assert all(u.split("=", 1)[1].startswith("https://") for u in flags["--initial-cluster"].split(","))
    assert {"--client-cert-auth", "--peer-client-cert-auth"} <= set(flags)
    assert flags["--peer-cert-allowed-cn"] == "etcd"
    for flag, name in (("--cert-file", "etcd.pem"), ("--key-file", "etcd.key"), ("--trusted-ca-file", "ca.pem"),
                       ("--peer-cert-file", "etcd.pem"), ("--peer-key-file", "etcd.key"),
                       ("--peer-trusted-ca-file", "ca.pem")):
        assert flags[flag] == f"{TLS_DIR}/{name}" and flags[flag] in files, flag
    mounted = {i["key"] for d in pods.values() for v in pod_spec(d).get("volumes", [])
               if v.get("secret", {}).get("secretName") == "flowmaker-tls" for i in v["secret"]["items"]}
    assert mounted <= pki_files


def test_docs_create_the_certificates_the_manifests_need() -> None:
    """docs/kubernetes.md's PKI command names every etcd member (clients dial etcd-N.etcd) and its Secret
    command takes every file the manifests mount, never the CA's key."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    [cmd] = [line for line in text.splitlines() if "python -m flowmaker.rpc.tls" in line and "--host" in line]
    assert all(f"--host etcd-{i}.etcd" in cmd for i in range(3)), cmd
    assert "ca.key" not in text.split("create secret generic flowmaker-tls", 1)[1].split("```", 1)[0]


def test_insecure_overlay_is_plaintext(insecure_docs: list[dict[str, Any]]) -> None:
    for d in workloads(insecure_docs):
        spec = pod_spec(d)
        for v in spec.get("volumes", []):
            if v.get("secret", {}).get("secretName") == "flowmaker-tls":
                assert v["secret"]["optional"] is True, d["metadata"]["name"]
        for c in spec["containers"]:
            names = {e["name"] for e in c.get("env", [])}
            assert not {n for n in names if re.search(r"_TLS(_|$)", n)}, c["name"]
            for a in c.get("args", []):
                assert "https://" not in a and "cert" not in a, a
    # Everything else is the example overlay's.
    example = k8s_render.render(K8S / "overlays" / "example")
    assert {(d["kind"], d["metadata"]["name"]) for d in insecure_docs} == \
        {(d["kind"], d["metadata"]["name"]) for d in example}


def test_renderer_applies_deletes(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("kind: ConfigMap\nmetadata: {name: x}\ndata: {a: '1', b: '2'}\n"
                                        "items: [{name: p, v: 1}, {name: q, v: 2}]\n")
    (tmp_path / "patch.yaml").write_text("kind: ConfigMap\nmetadata: {name: x}\ndata: {a: null}\n"
                                         "items: [{name: p, $patch: delete}]\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [base.yaml]\npatchesStrategicMerge: [patch.yaml]\n")
    [d] = k8s_render.render(tmp_path)
    assert d["data"] == {"b": "2"} and d["items"] == [{"name": "q", "v": 2}]


def test_overlay_sets_namespace_images_and_labels(docs: list[dict[str, Any]]) -> None:
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "flowmaker", d["metadata"]["name"]
    for d in workloads(docs):
        for c in pod_spec(d)["containers"]:
            if c["image"].startswith(("flowmaker", "registry.example.com")):
                assert c["image"].startswith("registry.example.com/flowmaker/") and c["image"].endswith(":0.1.0")
        if d["metadata"]["name"] in (*SERVICES, "gateway"):
            assert d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "flowmaker"
    gen = pod_spec(by_kind(docs, "Deployment")["generator"])["containers"][0]
    env = {e["name"]: e for e in gen["env"]}
    assert env["FLOWMAKER_GENERATOR_LLM_BASE_URL"]["value"].startswith("https://")  # the overlay's patch
    assert "valueFrom" in env["FLOWMAKER_GENERATOR_LLM_API_KEY"]  # the base's Secret reference survived


def test_dashboard_is_the_compose_one() -> None:
    assert (K8S / "base" / "flowmaker-dashboard.json").read_text() == \
        (ROOT / "compose" / "grafana" / "flowmaker-dashboard.json").read_text()


def test_renderer_refuses_what_it_does_not_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nreplacements: []\n")
    with pytest.raises(ValueError, match="replacements"):
        k8s_render.render(tmp_path)


def test_orchestrator_replicas_behind_a_headless_service(docs: list[dict[str, Any]]) -> None:
    """Two orchestrator replicas (one elected leader), each named by its pod, behind a headless Service whose DNS
    lists them all (clients balance round robin); a disruption budget keeps one serving."""
    d = by_kind(docs, "Deployment")["orchestrator"]
    assert d["spec"]["replicas"] == 2
    env = {e["name"]: e for e in pod_spec(d)["containers"][0]["env"]}
    assert env["FLOWMAKER_ORCHESTRATOR_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert by_kind(docs, "Service")["orchestrator"]["spec"]["clusterIP"] == "None"
    assert by_kind(docs, "PodDisruptionBudget")["orchestrator"]["spec"]["maxUnavailable"] == 1


ETCD_AUTH_DIR = "/etc/flowmaker/etcd-auth"


def test_etcd_roles_job_and_each_service_mounts_only_its_own_password(docs: list[dict[str, Any]]) -> None:
    """Issue 22, item 3: the etcd-auth Job runs the provisioner (`python -m flowmaker.state.etcd_auth provision`,
    the code `flowmaker up` calls) with every etcd member, the whole flowmaker-etcd-auth Secret and, with mTLS, a
    suite certificate; each etcd-using service logs in as its own user with only its own password mounted from
    that Secret (the deployer and the orchestrator also the engine-key sealing secret); the generator and the
    gateway have no etcd user and mount none of it. In both overlays (etcd auth needs no TLS)."""
    from flowmaker.state.etcd_auth import ENGINE_KEY_SECRET, ROLES, main, password_file

    secrets = by_kind(docs, "Secret")
    assert "flowmaker-etcd-auth" in secrets
    job = by_kind(docs, "Job")["etcd-auth"]
    spec = pod_spec(job)
    c = spec["containers"][0]
    assert c["command"] == ["python", "-m", "flowmaker.state.etcd_auth"]
    assert importlib.util.find_spec("flowmaker.state.etcd_auth") is not None and callable(main)
    args = dict(a.removeprefix("--").split("=", 1) if "=" in a else (a.removeprefix("--"), "") for a in c["args"])
    assert c["args"][0] == "provision" and "no-create" in args
    replicas = by_kind(docs, "StatefulSet")["etcd"]["spec"]["replicas"]
    assert args["endpoints"].split(",") == [f"etcd-{i}.etcd:2379" for i in range(replicas)]
    assert args["secrets-dir"] == ETCD_AUTH_DIR
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert vols[mounts[ETCD_AUTH_DIR]]["secret"] == {"secretName": "flowmaker-etcd-auth", "defaultMode": 288}
    if is_secure(docs):
        tls = vols[mounts[TLS_DIR]]["secret"]
        files = {f"{TLS_DIR}/{i['path']}" for i in tls["items"]}
        assert {args["tls-ca"], args["tls-cert"], args["tls-key"]} <= files and not tls.get("optional")
    else:
        assert not any(a.startswith("--tls") for a in c["args"])
    assert spec["restartPolicy"] == "OnFailure"
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "flowmaker"  # etcd's policy
    for d in workloads(docs):
        spec = pod_spec(d)
        for c in spec["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            p = f"FLOWMAKER_{c['name'].upper()}_"
            auth_vols = [v for v in spec.get("volumes", []) if v.get("secret", {}).get("secretName")
                         == "flowmaker-etcd-auth"]
            if c["name"] not in ROLES:
                assert p + "ETCD_USER" not in env and not auth_vols, c["name"]
                continue
            assert env[p + "ETCD_USER"] == c["name"]
            assert env[p + "ETCD_PASSWORD_FILE"] == str(password_file(ETCD_AUTH_DIR, c["name"]))
            (vol,) = auth_vols
            wanted = {f"{c['name']}.password"} | ({ENGINE_KEY_SECRET} if c["name"] in ("deployer", "orchestrator")
                                                  else set())
            assert {i["key"] for i in vol["secret"]["items"]} == {i["path"] for i in vol["secret"]["items"]} == wanted
            assert not vol["secret"].get("optional")
            mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
            assert mount["mountPath"] == ETCD_AUTH_DIR and mount["readOnly"] is True
            engine = env.get(p + "ENGINE_KEY_SECRET_FILE")
            assert (engine == f"{ETCD_AUTH_DIR}/{ENGINE_KEY_SECRET}") == (c["name"] in ("deployer", "orchestrator"))


def test_docs_create_the_etcd_auth_secret() -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "python -m flowmaker.state.etcd_auth secrets etcd-auth" in text
    block = text.split("create secret generic flowmaker-etcd-auth", 1)[1].split("```", 1)[0]
    assert "etcd-auth" in block
