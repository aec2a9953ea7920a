"""The profiler service on a real etcd and a real gRPC server: registration, analytic profiles stored in etcd,
and a measured sweep of real emulated engines whose fitted coefficients land within 10% of the emulator's."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import pytest

from flowmaker import convert
from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
from flowmaker.catalog import get_gpu_type, get_model
from flowmaker.domain import ProfileSource
from flowmaker.errors import AlreadyExists, InvalidSpec, NotFound
from flowmaker.profiling.analytic import analytic_profile
from flowmaker.rpc.errors import call
from flowmaker.state import keys
from services.profiler.app import build
from services.profiler.servicer import add_servicers
from services.profiler.settings import ProfilerSettings

pytestmark = pytest.mark.integration

PC = profiler_pb2.ProfileConfig
PJ = profiler_pb2.ProfilingJob

# Llama-3.2-1B's config.json (Hugging Face), trimmed to the keys the importer reads.
LLAMA_1B_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
                   "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
                   "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
                   "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


async def _profiler(start_service: Any, store: Any, **overrides: Any) -> tuple[Any, profiler_pb2_grpc.ProfilerServiceStub,
                                                                             grpc.aio.Channel]:
    settings = ProfilerSettings(host="127.0.0.1", port=0, grace_s=0.5, preload_catalog=False,
                                analytic_gpu_types="A6000", engine_time_scale=4.0, sweep_repeats=5,
                                sweep_output_tokens="4,16,64", throughput_output_tokens=64, max_concurrency=128,
                                **overrides)
    app = build(settings, store)
    running = await start_service("profiler", lambda s: add_servicers(s, app.servicer), settings,
                                  on_ready=app.start, on_shutdown=[app.close])
    ch = grpc.aio.insecure_channel(running.address)
    return app, profiler_pb2_grpc.ProfilerServiceStub(ch), ch


async def test_register_list_and_analytic_profiles(start_service: Any, etcd_store: Any) -> None:
    _app, stub, ch = await _profiler(start_service, etcd_store)
    async with ch:
        r = await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name="Llama-3.1-8B-Instruct")))
        assert r.model.id == "Llama-3.1-8B-Instruct" and r.model.arch.layers == 32
        hf = await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(
            hf_config_json=json.dumps(LLAMA_1B_CONFIG), model_id="my-1b", accuracy=0.31, hf_id="me/my-1b")))
        assert hf.model.accuracy == pytest.approx(0.31) and 1.2 < hf.model.params_b < 1.3
        models = await call(stub.ListModels(profiler_pb2.ListModelsRequest()))
        assert [m.id for m in models.models] == ["Llama-3.1-8B-Instruct", "my-1b"]

        # Analytic profiles were stored at registration, one key per config that runs.
        kv = await etcd_store.get(keys.profile("A6000", "my-1b", 2, 1, "ANALYTIC"))
        assert kv is not None and kv.value["source"] == "ANALYTIC"
        resp = await call(stub.GetProfiles(profiler_pb2.GetProfilesRequest(model_id="my-1b", gpu_type="A6000")))
        shapes = [(c.config.tp, c.config.pp) for c in resp.configs]
        assert len(shapes) == 10 and shapes[0] == (1, 1) and shapes == sorted(shapes, key=lambda c: (c[0] * c[1], c[0]))
        assert all(c.state == PC.State.STATE_ANALYTIC for c in resp.configs)
        p11 = convert.profile_from_proto(resp.configs[0].profile)
        assert p11.source is ProfileSource.ANALYTIC
        assert p11.decode_s_per_token == pytest.approx(
            analytic_profile(get_model("Llama-3.2-1B-Instruct"), get_gpu_type("A6000"), 1, 1).decode_s_per_token,
            rel=0.02)
        # A GPU type not stored at registration is computed and stored on first use.
        h100 = await call(stub.GetProfiles(profiler_pb2.GetProfilesRequest(
            model_id="Llama-3.1-8B-Instruct", gpu_type="H100", configs=[profiler_pb2.ParallelConfig(tp=2, pp=1)])))
        assert [(c.config.tp, c.config.pp) for c in h100.configs] == [(2, 1)]
        assert await etcd_store.get(keys.profile("H100", "Llama-3.1-8B-Instruct", 2, 1, "ANALYTIC")) is not None

        # Errors name the field.
        with pytest.raises(AlreadyExists) as e1:
            await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name="Llama-3.1-8B-Instruct")))
        assert e1.value.field == "model_id"
        with pytest.raises(InvalidSpec) as e2:
            await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(hf_config_json="{oops", model_id="x",
                                                                            accuracy=0.5)))
        assert e2.value.field == "hf_config_json"
        with pytest.raises(InvalidSpec) as e3:
            await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(
                hf_config_json=json.dumps(LLAMA_1B_CONFIG), model_id="y")))
        assert e3.value.field == "accuracy"
        with pytest.raises(InvalidSpec) as e4:
            await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name="Qwen2.5-7B-Instruct",
                                                                            accuracy=1.5)))
        assert e4.value.field == "accuracy"
        with pytest.raises(NotFound) as e5:
            await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name="gpt-17")))
        assert e5.value.field == "catalog_name"
        with pytest.raises(NotFound) as e6:
            await call(stub.GetProfiles(profiler_pb2.GetProfilesRequest(model_id="nope")))
        assert e6.value.field == "model_id"
        with pytest.raises(InvalidSpec) as e7:  # 32 heads are not divisible by tp=3
            await call(stub.GetProfiles(profiler_pb2.GetProfilesRequest(
                model_id="my-1b", configs=[profiler_pb2.ParallelConfig(tp=3, pp=1)])))
        assert e7.value.field == "configs[0]" and "divisible" in e7.value.message
        with pytest.raises(NotFound) as e8:
            await call(stub.GetProfilingJob(profiler_pb2.GetProfilingJobRequest(job_id="prof-none")))
        assert e8.value.field == "job_id"


# Time scale 4: the emulator's timers have ~1 ms of wall-clock jitter, which the scale multiplies; at 4 the
# fixed_s of a 7-8B model (25 ms) is recovered to a few %, at 20 only to ~25% (see flowmaker.profiling.measure).
async def test_measured_sweep_within_10_percent(start_service: Any, etcd_store: Any) -> None:
    _app, stub, ch = await _profiler(start_service, etcd_store)
    model, gpu = "Llama-3.1-8B-Instruct", get_gpu_type("A6000")
    async with ch:
        await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name=model)))
        req = profiler_pb2.ProfileModelRequest(model_id=model, gpu_type="A6000",
                                               configs=[profiler_pb2.ParallelConfig(tp=2, pp=1)])
        job = (await call(stub.ProfileModel(req))).job
        assert job.configs_total == 1 and job.state in (PJ.State.STATE_QUEUED, PJ.State.STATE_RUNNING)
        again = (await call(stub.ProfileModel(req))).job
        assert again.id == job.id  # the same model and GPU type: the running job, not a second one

        saw_measuring = False
        deadline = time.monotonic() + 180
        while True:
            got = (await call(stub.GetProfilingJob(profiler_pb2.GetProfilingJobRequest(job_id=job.id)))).job
            if got.state in (PJ.State.STATE_SUCCEEDED, PJ.State.STATE_FAILED):
                break
            profiles = await call(stub.GetProfiles(profiler_pb2.GetProfilesRequest(
                model_id=model, gpu_type="A6000", configs=[profiler_pb2.ParallelConfig(tp=2, pp=1)])))
            saw_measuring |= profiles.configs[0].state == PC.State.STATE_MEASURING
            assert time.monotonic() < deadline, "sweep did not finish"
            await asyncio.sleep(1.0)
        assert got.state == PJ.State.STATE_SUCCEEDED, got.failure.message
        assert got.configs_done == 1 and saw_measuring

        resp = await call(stub.GetProfiles(profiler_pb2.GetProfilesRequest(model_id=model, gpu_type="A6000")))
        by_shape = {(c.config.tp, c.config.pp): c for c in resp.configs}
        assert by_shape[(2, 1)].state == PC.State.STATE_MEASURED
        assert by_shape[(1, 1)].state == PC.State.STATE_ANALYTIC
        measured = convert.profile_from_proto(by_shape[(2, 1)].profile)
        assert measured.source is ProfileSource.MEASURED
        # The emulator was built from the analytic profile: the fit must recover it.
        truth = analytic_profile(get_model(model), gpu, 2, 1)
        for f in ("fixed_s", "prefill_s_per_token", "decode_s_per_token", "max_output_tokens_per_s"):
            assert getattr(measured, f) == pytest.approx(getattr(truth, f), rel=0.10), f
        assert measured.memory_gb_per_gpu == pytest.approx(truth.memory_gb_per_gpu)
        kv = await etcd_store.get(keys.profile("A6000", model, 2, 1, "MEASURED"))
        assert kv is not None and kv.value["job_id"] == job.id and kv.value["memory_source"] == "engine"
