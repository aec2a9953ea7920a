"""The emulated backend: a `flowmaker.engine.server` process whose timing follows the instance's profile."""

from __future__ import annotations

import sys
from typing import ClassVar

from flowmaker.engine.server import profile_to_json
from services.deployer.backends.base import EngineBackend, EngineSpec


class EmulatedBackend(EngineBackend):
    """Needs no GPU. CUDA_VISIBLE_DEVICES is still set from the placement (ignored), so that the
    process environment looks the same for every backend. `spec.extra_args` go to the server
    (e.g. `("--time-scale", "10")`; the node agent adds `--gpu-ids` and `--gpu-share-dir`, so that the
    emulated engines on one GPU share it: `flowmaker.engine.gpu_share`)."""

    name: ClassVar[str] = "emulated"
    announces_port: ClassVar[bool] = True  # prints `LISTENING <port>`, so port 0 works

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def build_command(self, spec: EngineSpec) -> list[str]:
        return [self.python, "-m", "flowmaker.engine.server", "--model", self.served_model_name(spec),
                "--profile-json", profile_to_json(spec.profile), "--host", spec.host, "--port", str(spec.port),
                *spec.extra_args]
