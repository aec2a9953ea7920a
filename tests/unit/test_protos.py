"""The protobuf contract: generated modules import, services carry their RPCs, buf style holds, no drift."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor as _descriptor

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"

SERVICES = {
    "generator": ("GeneratorService", {"GenerateWorkflows"}),
    "profiler": ("ProfilerService", {"RegisterModel", "ListModels", "GetProfiles", "ProfileModel",
                                     "GetProfilingJob"}),
    "selector": ("SelectorService", {"SelectVariant"}),
    "deployer": ("DeployerService", {"Deploy", "Release", "ListInstances", "ListGpus"}),
    "orchestrator": ("OrchestratorService", {"DeployTask", "ApproveWorkflows", "GetTask", "ListTasks", "DeleteTask",
                                             "Invoke", "InvokeStream", "CreateUser", "CreateToken", "ListUsers",
                                             "Revoke"}),
}
COMMON = ("workflow", "cluster", "selection", "task")


def _all_files() -> list[_descriptor.FileDescriptor]:
    mods = [importlib.import_module(f"flowmaker.api.common.v1.{c}_pb2") for c in COMMON]
    mods += [importlib.import_module(f"flowmaker.api.{s}.v1.{s}_pb2") for s in SERVICES]
    return [m.DESCRIPTOR for m in mods]


def _messages(desc: _descriptor.Descriptor) -> list[_descriptor.Descriptor]:
    out = [desc]
    for n in desc.nested_types:
        out += _messages(n)
    return out


@pytest.mark.parametrize("svc", sorted(SERVICES))
def test_service_modules_import_and_carry_their_rpcs(svc: str) -> None:
    pb2 = importlib.import_module(f"flowmaker.api.{svc}.v1.{svc}_pb2")
    grpc_mod = importlib.import_module(f"flowmaker.api.{svc}.v1.{svc}_pb2_grpc")
    name, rpcs = SERVICES[svc]
    sd = pb2.DESCRIPTOR.services_by_name[name]
    assert sd.full_name == f"flowmaker.{svc}.v1.{name}"
    assert {m.name for m in sd.methods} == rpcs
    for m in sd.methods:  # buf style: one Request/Response pair per RPC
        assert m.input_type.name == f"{m.name}Request"
        assert m.output_type.name == f"{m.name}Response"
    for attr in (f"{name}Stub", f"{name}Servicer", f"add_{name}Servicer_to_server"):
        assert hasattr(grpc_mod, attr), attr
    # The Python module path moved under flowmaker.api; the proto package did not.
    assert pb2.__name__ == f"flowmaker.api.{svc}.v1.{svc}_pb2"
    msg_cls = getattr(pb2, sd.methods[0].input_type.name)
    assert msg_cls.__module__ == pb2.__name__


def test_invoke_stream_is_server_streaming() -> None:
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2
    m = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].methods_by_name["InvokeStream"]
    assert m.server_streaming and not m.client_streaming


def test_common_modules_import_alongside_the_etcd_client() -> None:
    # aetcd registers top-level kv.proto/rpc.proto/auth.proto in the default pool; ours must not clash.
    pytest.importorskip("aetcd")
    import aetcd  # noqa: F401

    files = _all_files()
    assert all(f.name.startswith("flowmaker/") for f in files)


def test_no_proto_file_clashes_with_etcd_names() -> None:
    names = {p.name for p in PROTOS.rglob("*.proto")}
    assert not names & {"kv.proto", "rpc.proto", "auth.proto"}


def test_packages_are_versioned_and_enums_have_unspecified_zero() -> None:
    for f in _all_files():
        assert f.package.startswith("flowmaker.") and f.package.endswith(".v1"), f.name
        enums = list(f.enum_types_by_name.values())
        for m in f.message_types_by_name.values():
            for d in _messages(m):
                enums += list(d.enum_types)
        for e in enums:
            zero = e.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), f"{e.full_name}: zero value {zero}"


def test_lifecycle_states() -> None:
    from flowmaker.api.common.v1 import cluster_pb2, task_pb2
    assert {"STATE_READY", "STATE_FAILED"} <= set(cluster_pb2.Instance.State.keys())
    assert {"STATE_ACTIVE", "STATE_DEGRADED", "STATE_FAILED"} <= set(task_pb2.Task.State.keys())
    # Failures travel as google.rpc.Status.
    failure: Any = task_pb2.Task.DESCRIPTOR.fields_by_name["failure"]
    assert failure.message_type.full_name == "google.rpc.Status"


def _names(desc: Any) -> set[str]:
    return {f.name for f in desc.fields}


def test_select_variant_request_has_the_spec_field_names() -> None:
    """spec/selection.md fixes these snake_case names; a request written with them must parse."""
    from flowmaker.api.selector.v1 import selector_pb2
    req: Any = selector_pb2.SelectVariantRequest.DESCRIPTOR
    assert _names(req) == {"slo", "workflows", "models", "profiles", "cluster", "options", "strategy"}
    f = req.fields_by_name
    assert {"min_accuracy", "max_latency_s", "arrival_rate_rps"} == _names(f["slo"].message_type)
    stage = f["workflows"].message_type.fields_by_name["stages"].message_type
    assert {"id", "kind", "depends_on", "input_tokens", "output_tokens", "calls_per_request",
            "latency_s"} <= _names(stage)
    assert {"id", "accuracy", "params_b", "active_params_b"} <= _names(f["models"].message_type)
    assert {"model_id", "tp", "pp", "memory_gb_per_gpu", "fixed_s", "prefill_s_per_token", "decode_s_per_token",
            "max_output_tokens_per_s"} <= _names(f["profiles"].message_type)
    cluster = f["cluster"].message_type.fields_by_name
    assert {"id", "node", "memory_total_gb", "memory_used_gb"} <= _names(cluster["gpus"].message_type)
    assert {"id", "model_id", "tp", "pp", "gpu_ids", "load_output_tokens_per_s"} <= _names(
        cluster["instances"].message_type)
    opts = f["options"].message_type
    assert {"utilization_cap", "allow_reuse", "time_budget_s", "max_trials", "seed", "max_replicas", "capacity_model",
            "gpu_sharing", "interference", "gpu_price_gb"} == _names(opts)
    # "default true" needs presence: absence must be distinguishable from false.
    assert opts.fields_by_name["allow_reuse"].has_presence


def test_select_variant_response_mirrors_selection_result() -> None:
    import dataclasses

    from flowmaker.api.selector.v1 import selector_pb2
    from flowmaker.domain import SelectionResult, Variant
    resp: Any = selector_pb2.SelectVariantResponse.DESCRIPTOR
    assert {f.name for f in dataclasses.fields(SelectionResult)} | {"feasible"} == _names(resp)
    assert {f.name for f in dataclasses.fields(Variant)} == _names(resp.fields_by_name["variant"].message_type)


def _load_gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_code_matches_protos() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_drift_check_lists_changed_missing_and_stale_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    gen = _load_gen_protos()
    api = tmp_path / "api"
    shutil.copytree(ROOT / "flowmaker" / "api", api, ignore=shutil.ignore_patterns("__pycache__"))
    (api / "selector" / "v1" / "selector_pb2.pyi").write_text("# edited by hand\n")
    (api / "deployer" / "v1" / "deployer_pb2.py").unlink()
    (api / "selector" / "v1" / "old_pb2.py").write_text("")
    monkeypatch.setattr(gen, "API_DIR", api)
    assert gen.check() == 1
    err = capsys.readouterr().err
    assert "differs:  flowmaker/api/selector/v1/selector_pb2.pyi" in err
    assert "missing:  flowmaker/api/deployer/v1/deployer_pb2.py" in err
    assert "stale:    flowmaker/api/selector/v1/old_pb2.py" in err


def _buf() -> str | None:
    return shutil.which("buf") or shutil.which("buf", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(_buf() is None, reason="buf CLI (pip install buf-bin) not installed")
def test_buf_lint_is_clean() -> None:
    buf = _buf()
    assert buf is not None
    r = subprocess.run([buf, "lint"], cwd=PROTOS, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
