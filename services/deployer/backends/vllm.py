"""The vLLM backend: `vllm serve` (CUDA wheels only; `pip install flowmaker[vllm]` on GPU hosts).

Command:
    vllm serve HF_ID --host H --port P --served-model-name MODEL_ID --tensor-parallel-size TP
               --pipeline-parallel-size PP --gpu-memory-utilization F [extra_args...]
Clients send `model: MODEL_ID`. /metrics is Prometheus text with `vllm:` names.
"""

from __future__ import annotations

from typing import ClassVar

from services.deployer.backends.base import EngineBackend, EngineSpec


class VllmBackend(EngineBackend):
    name: ClassVar[str] = "vllm"

    def __init__(self, executable: str = "vllm", gpu_memory_utilization: float = 0.9) -> None:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be within (0, 1]")
        self.executable = executable
        self.gpu_memory_utilization = gpu_memory_utilization

    def build_command(self, spec: EngineSpec) -> list[str]:
        return [self.executable, "serve", spec.hf_id or spec.model_id, "--host", spec.host, "--port", str(spec.port),
                "--served-model-name", spec.model_id, "--tensor-parallel-size", str(spec.tp),
                "--pipeline-parallel-size", str(spec.pp),
                "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}", *spec.extra_args]
