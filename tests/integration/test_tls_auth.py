"""mTLS and authorization on the real suite (real etcd, the five gRPC servers on port 0, each with its own
certificate from a local CA, as `flowmaker up` runs them): every listener refuses plaintext and callers
without credentials, the deployer takes writes only from the orchestrator and the profiler, and one user
cannot touch another user's task."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowmaker.api.common.v1 import workflow_pb2
from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
from flowmaker.bench.fuzz import fuzz_stack
from flowmaker.rpc.auth import write_tokens
from flowmaker.rpc.tls import ensure_pki, pki_files

pytestmark = pytest.mark.integration

SLO = workflow_pb2.Slo(min_accuracy=0.1, max_latency_s=30.0, arrival_rate_rps=0.5)
TOKENS = {"alice-token-0123456789": {"user": "alice"}, "bob-token-0123456789": {"user": "bob"},
          "root-token-0123456789": {"user": "root", "admin": True}}
ONE = workflow_pb2.Workflow(id="one", stages=[workflow_pb2.Stage(id="answer", input_tokens=50, output_tokens=5,
                                                                 prompt_template="{input}")])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ensure_pki(d)
    write_tokens(d / "tokens.json", TOKENS)
    return d


class Secure:
    def __init__(self, addrs: dict[str, str], pki: Path) -> None:
        self.addrs = addrs
        self.pki = pki
        self._channels: list[grpc.aio.Channel] = []

    def channel(self, svc: str, identity: str | None = "admin", *, ca: Path | None = None) -> grpc.aio.Channel:
        """A TLS channel to `svc` presenting `identity`'s certificate (None = no client certificate)."""
        ca_bytes = (ca or self.pki / "ca.pem").read_bytes()
        if identity is None:
            creds = grpc.ssl_channel_credentials(root_certificates=ca_bytes)
        else:
            f = pki_files(self.pki, identity)
            creds = grpc.ssl_channel_credentials(ca_bytes, Path(f.key).read_bytes(), Path(f.cert).read_bytes())
        ch = grpc.aio.secure_channel(self.addrs[svc], creds)
        self._channels.append(ch)
        return ch

    def orch(self, token: str | None) -> tuple[orchestrator_pb2_grpc.OrchestratorServiceStub, list[tuple[str, str]]]:
        md = [("authorization", f"Bearer {token}")] if token else []
        return orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel("orchestrator", None)), md

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close(None)


@pytest.fixture
async def secure(etcd_store: Any, pki: Path) -> AsyncIterator[Secure]:
    async with fuzz_stack(etcd_store, pki=str(pki), tokens_file=str(pki / "tokens.json")) as addrs:
        s = Secure(addrs, pki)
        yield s
        await s.close()


async def code_of(call: Any) -> grpc.StatusCode:
    try:
        r = call
        if hasattr(r, "__aiter__"):
            async for _ in r:
                pass
        else:
            await r
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_every_listener_refuses_plaintext_and_strangers(secure: Secure, tmp_path: Path) -> None:
    other = ensure_pki(tmp_path / "other-ca", ["admin"])  # a certificate the suite's CA did not sign
    for svc, addr in secure.addrs.items():
        plain = grpc.aio.insecure_channel(addr)
        try:
            assert await code_of(health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE, svc
        finally:
            await plain.close(None)
        foreign = grpc.aio.secure_channel(addr, grpc.ssl_channel_credentials(
            (secure.pki / "ca.pem").read_bytes(), (other / "admin.key").read_bytes(), (other / "admin.pem").read_bytes()))
        try:
            if svc == "orchestrator":
                # It takes callers without certificates (users come with tokens): a foreign certificate
                # gets through the handshake, but is no identity; without a token the API says no.
                code = await code_of(orchestrator_pb2_grpc.OrchestratorServiceStub(foreign).ListTasks(
                    pb.ListTasksRequest(), timeout=5))
                assert code == grpc.StatusCode.UNAUTHENTICATED
            else:
                code = await code_of(health_pb2_grpc.HealthStub(foreign).Check(health_pb2.HealthCheckRequest(),
                                                                               timeout=5))
                assert code == grpc.StatusCode.UNAVAILABLE, svc  # the handshake fails
        finally:
            await foreign.close(None)
        no_cert = health_pb2_grpc.HealthStub(secure.channel(svc, None))
        code = await code_of(no_cert.Check(health_pb2.HealthCheckRequest(), timeout=5))
        if svc == "orchestrator":
            assert code == grpc.StatusCode.OK  # health is open; the API is not (below)
        else:
            assert code == grpc.StatusCode.UNAVAILABLE, svc  # no client certificate: no handshake
        ok = health_pb2_grpc.HealthStub(secure.channel(svc, "admin"))
        assert (await ok.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
            health_pb2.HealthCheckResponse.SERVING
    # At the orchestrator a certificate is no identity (gRPC does not ask for one there): tokens are.
    admin = orchestrator_pb2_grpc.OrchestratorServiceStub(secure.channel("orchestrator", "admin"))
    assert await code_of(admin.ListTasks(pb.ListTasksRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED


async def test_orchestrator_needs_a_token(secure: Secure) -> None:
    stub, _ = secure.orch(None)
    assert await code_of(stub.ListTasks(pb.ListTasksRequest())) == grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=[("authorization", "Bearer nope")])) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=[("authorization", "Basic eDp5")])) == \
        grpc.StatusCode.UNAUTHENTICATED
    # rejected before anything else: no validation feedback for strangers
    assert await code_of(stub.GetTask(pb.GetTaskRequest(task_id="../x"))) == grpc.StatusCode.UNAUTHENTICATED


async def test_deployer_writes_only_from_orchestrator_or_profiler(secure: Secure) -> None:
    deploy = deployer_pb2.DeployRequest(model_id="no-such-model", tp=1, pp=1, gpu_ids=["n0-gpu0"],
                                        memory_gb_per_gpu=1e-6, no_wait=True)
    release = deployer_pb2.ReleaseRequest(instance_id="some-instance")
    for ident in ("admin", "selector", "generator", "deployer"):
        stub = deployer_pb2_grpc.DeployerServiceStub(secure.channel("deployer", ident))
        assert await code_of(stub.Deploy(deploy)) == grpc.StatusCode.PERMISSION_DENIED, ident
        assert await code_of(stub.Release(release)) == grpc.StatusCode.PERMISSION_DENIED, ident
        assert await code_of(stub.ListGpus(deployer_pb2.ListGpusRequest())) == grpc.StatusCode.OK, ident
    for ident in ("orchestrator", "profiler"):
        stub = deployer_pb2_grpc.DeployerServiceStub(secure.channel("deployer", ident))
        assert await code_of(stub.Deploy(deploy)) == grpc.StatusCode.NOT_FOUND, ident  # past the policy
    # The profiler, too, serves only the suite: a user token is no way in.
    prof = profiler_pb2_grpc.ProfilerServiceStub(secure.channel("profiler", None))
    assert await code_of(prof.ListModels(profiler_pb2.ListModelsRequest(), metadata=[
        ("authorization", "Bearer alice-token-0123456789")])) == grpc.StatusCode.UNAVAILABLE


async def test_only_the_admin_claims_an_accuracy(secure: Secure) -> None:
    """A suite certificate (here the generator's) registers catalog models with their published accuracy, but
    cannot claim one: a Llama-3.2-1B clone at accuracy 1.0 once let tasks asking for 0.95 go ACTIVE (issue 22)."""
    hf = json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                     "num_attention_heads": 4, "vocab_size": 1000})
    claims = [profiler_pb2.RegisterModelRequest(hf_config_json=hf, model_id="clone-1", accuracy=1.0),
              profiler_pb2.RegisterModelRequest(catalog_name="Llama-3.2-1B-Instruct", model_id="clone-2",
                                                accuracy=1.0)]
    for ident in ("generator", "selector", "orchestrator", "deployer", "profiler"):
        stub = profiler_pb2_grpc.ProfilerServiceStub(secure.channel("profiler", ident))
        for req in claims:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.RegisterModel(req)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, ident
            assert "admin" in (e.value.details() or "")
        # the catalog's own figure is fine from anyone in the suite
        ok = await stub.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name="Llama-3.2-1B-Instruct",
                                                                        model_id=f"llama-1b-by-{ident}"))
        assert ok.model.accuracy < 0.2 and "claimed" not in ok.model.source
    listed = await profiler_pb2_grpc.ProfilerServiceStub(secure.channel("profiler", "generator")).ListModels(
        profiler_pb2.ListModelsRequest())
    assert not {"clone-1", "clone-2"} & {m.id for m in listed.models}
    admin = profiler_pb2_grpc.ProfilerServiceStub(secure.channel("profiler", "admin"))
    m = (await admin.RegisterModel(claims[0])).model
    assert m.accuracy == 1.0 and "claimed by admin" in m.source


async def test_one_owner_cannot_touch_another_owners_task(secure: Secure) -> None:
    alice, a_md = secure.orch("alice-token-0123456789")
    bob, b_md = secure.orch("bob-token-0123456789")
    root, r_md = secure.orch("root-token-0123456789")
    # No workflows given: the orchestrator asks the generator over mTLS.
    t = (await alice.DeployTask(pb.DeployTaskRequest(description="summarise support tickets", slo=SLO),
                                metadata=a_md)).task
    assert t.candidates
    t2 = (await alice.DeployTask(pb.DeployTaskRequest(description="answer", slo=SLO, workflows=[ONE]),
                                 metadata=a_md)).task
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert await code_of(bob.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=b_md)) == denied
    assert await code_of(bob.Invoke(pb.InvokeRequest(task_id=t.id, input="x"), metadata=b_md)) == denied
    assert await code_of(bob.InvokeStream(pb.InvokeStreamRequest(task_id=t.id, input="x"), metadata=b_md)) == denied
    assert await code_of(bob.ApproveWorkflows(pb.ApproveWorkflowsRequest(
        task_id=t.id, workflow_ids=[t.candidates[0].id]), metadata=b_md)) == denied
    assert await code_of(bob.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), metadata=b_md)) == denied
    # the same answer for a task that does not exist: ids cannot be probed
    assert await code_of(bob.GetTask(pb.GetTaskRequest(task_id="no-such-task"), metadata=b_md)) == denied
    assert [x.id for x in (await bob.ListTasks(pb.ListTasksRequest(), metadata=b_md)).tasks] == []
    assert sorted(x.id for x in (await alice.ListTasks(pb.ListTasksRequest(), metadata=a_md)).tasks) == \
        sorted([t.id, t2.id])
    assert (await alice.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=a_md)).task.id == t.id
    assert (await root.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=r_md)).task.id == t.id  # admin
    assert await code_of(root.GetTask(pb.GetTaskRequest(task_id="no-such-task"), metadata=r_md)) == \
        grpc.StatusCode.NOT_FOUND
    await alice.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), metadata=a_md)
    assert [x.id for x in (await alice.ListTasks(pb.ListTasksRequest(), metadata=a_md)).tasks] == [t2.id]
    await root.DeleteTask(pb.DeleteTaskRequest(task_id=t2.id), metadata=r_md)


async def test_secure_stack_end_to_end(secure: Secure) -> None:
    """Approve + invoke over mTLS everywhere: orchestrator -> selector -> deployer (as the orchestrator)
    -> an engine; the deployer's Deploy only admits the orchestrator's certificate, so this is the path."""
    alice, md = secure.orch("alice-token-0123456789")
    t = (await alice.DeployTask(pb.DeployTaskRequest(description="answer", slo=SLO, workflows=[ONE]),
                                metadata=md)).task
    t = (await alice.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=t.id, workflow_ids=["one"]),
                                      metadata=md, timeout=60)).task
    assert t.state == t.STATE_ACTIVE, t.failure.message
    r = await alice.Invoke(pb.InvokeRequest(task_id=t.id, input="hello there", max_output_tokens=3),
                           metadata=md, timeout=30)
    assert len(r.output.split()) == 3
    # The orchestrator used the engine's per-instance key; nobody else gets through without it.
    dep = deployer_pb2_grpc.DeployerServiceStub(secure.channel("deployer", "admin"))
    (inst,) = (await dep.ListInstances(deployer_pb2.ListInstancesRequest())).instances
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(inst.endpoint + "/v1/chat/completions", json={
                "model": inst.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as resp:
            assert resp.status == 401
    d = await alice.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), metadata=md, timeout=60)
    assert list(d.released_instance_ids) == list(t.stage_instances.values())


async def test_tokens_without_tls(etcd_store: Any, pki: Path) -> None:
    """A tokens file without TLS files (the Kubernetes base: plaintext inside the namespace): the orchestrator
    still authenticates every call and keeps owners apart."""
    async with fuzz_stack(etcd_store, tokens_file=str(pki / "tokens.json")) as addrs:
        ch = grpc.aio.insecure_channel(addrs["orchestrator"])
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        try:
            assert await code_of(stub.ListTasks(pb.ListTasksRequest())) == grpc.StatusCode.UNAUTHENTICATED
            alice = [("authorization", "Bearer alice-token-0123456789")]
            bob = [("authorization", "Bearer bob-token-0123456789")]
            t = (await stub.DeployTask(pb.DeployTaskRequest(description="d", slo=SLO, workflows=[ONE]),
                                       metadata=alice)).task
            assert await code_of(stub.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=bob)) == \
                grpc.StatusCode.PERMISSION_DENIED
            assert (await stub.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=alice)).task.id == t.id
        finally:
            await ch.close(None)


def test_pki_files(pki: Path) -> None:
    for ident in ("orchestrator", "deployer", "admin", "etcd"):
        f = pki_files(pki, ident)
        assert Path(f.cert).exists() and (Path(f.key).stat().st_mode & 0o077) == 0
    assert json.loads((pki / "tokens.json").read_text())["alice-token-0123456789"]["user"] == "alice"


async def test_etcd_over_mtls(pki: Path, tmp_path: Path) -> None:
    """etcd as `flowmaker up` starts it (--client-cert-auth, the stack's CA): the store connects with a
    suite certificate; plaintext, or a certificate of another CA, gets nothing."""
    import os
    import shutil
    import subprocess
    import time
    import urllib.request

    from flowmaker.errors import Unavailable
    from flowmaker.state.etcd import EtcdStore

    etcd_bin = os.environ.get("FLOWMAKER_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")
    if not os.path.exists(etcd_bin):
        pytest.skip("etcd not installed")
    from flowmaker.ports import free_ports

    cport, pport = free_ports(2)
    f = pki_files(pki, "etcd")
    curl, purl = f"https://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    proc = subprocess.Popen([etcd_bin, "--name", "t", "--data-dir", str(tmp_path / "data"), "--listen-client-urls", curl,
                             "--advertise-client-urls", curl, "--listen-peer-urls", purl,
                             "--initial-advertise-peer-urls", purl, "--initial-cluster", f"t={purl}",
                             "--cert-file", f.cert, "--key-file", f.key, "--trusted-ca-file", f.ca, "--client-cert-auth",
                             "--log-level", "error", "--logger", "zap"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        import ssl

        ctx = ssl.create_default_context(cafile=f.ca)
        admin = pki_files(pki, "admin")
        ctx.load_cert_chain(admin.cert, admin.key)
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(curl + "/health", timeout=1, context=ctx) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "etcd with TLS did not start"
                time.sleep(0.1)
        good = EtcdStore(f"127.0.0.1:{cport}", namespace="/tls", timeout_s=2.0, tls=pki_files(pki, "deployer"))
        try:
            await good.put("/k", {"v": 1})
            assert (await good.get("/k")).value == {"v": 1}  # type: ignore[union-attr]
        finally:
            await good.close()
        other = ensure_pki(tmp_path / "other", ["deployer"])
        for tls in (None, pki_files(other, "deployer")):
            bad = EtcdStore(f"127.0.0.1:{cport}", namespace="/tls", timeout_s=1.0, tls=tls)
            try:
                with pytest.raises(Unavailable):
                    await bad.get("/k")
            finally:
                await bad.close()
    finally:
        proc.terminate()
        proc.wait(10)
