"""The TensorRT-LLM backend: `trtllm-serve` with the PyTorch backend (no engine build step).

Command (flag names as in TensorRT-LLM's `trtllm-serve`, which uses underscores):
    trtllm-serve MODEL --host H --port P --backend pytorch --tp_size TP --pp_size PP
                 --kv_cache_free_gpu_memory_fraction F [extra_args...]
MODEL is the Hugging Face id (or a local checkpoint path); trtllm-serve serves it under that
same name, so clients send `model: MODEL`. `tensorrt-llm` is not installable from PyPI alone
(`pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com`); it is an optional extra.
Its /metrics is JSON iteration stats, parsed by `parse_trtllm_iteration_stats`.
"""

from __future__ import annotations

from typing import ClassVar

from services.deployer.backends.base import EngineBackend, EngineSpec, parse_trtllm_iteration_stats


class TrtllmBackend(EngineBackend):
    name: ClassVar[str] = "trtllm"
    # trtllm-serve has no --api-key (NVIDIA/TensorRT-LLM#9950): with per-instance keys it runs on loopback
    # behind `flowmaker.engine.keyproxy`, which checks the key (EngineProcess.start).
    checks_api_key: ClassVar[bool] = False

    def __init__(self, executable: str = "trtllm-serve", kv_cache_free_gpu_memory_fraction: float = 0.9) -> None:
        if not 0.0 < kv_cache_free_gpu_memory_fraction <= 1.0:
            raise ValueError("kv_cache_free_gpu_memory_fraction: must be within (0, 1]")
        self.executable = executable
        self.kv_fraction = kv_cache_free_gpu_memory_fraction

    def served_model_name(self, spec: EngineSpec) -> str:
        return spec.hf_id or spec.model_id

    def build_command(self, spec: EngineSpec) -> list[str]:
        return [self.executable, self.served_model_name(spec), "--host", spec.host, "--port", str(spec.port),
                "--backend", "pytorch", "--tp_size", str(spec.tp), "--pp_size", str(spec.pp),
                "--kv_cache_free_gpu_memory_fraction", f"{self.kv_fraction:g}", *spec.extra_args]

    def parse_metrics(self, content_type: str, body: str) -> dict[str, float]:
        return parse_trtllm_iteration_stats(body)
