"""Settings of the gateway (env prefix FLOWMAKER_GATEWAY_): where it listens, which orchestrator it calls."""

from __future__ import annotations

import json
import logging

from pydantic import Field
from pydantic_settings import BaseSettings

from flowmaker.settings import DEFAULT_PORTS, settings_config

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000


class GatewaySettings(BaseSettings):
    """Everything `python -m services.gateway` reads from the environment. An HTTP service: no etcd."""

    model_config = settings_config("gateway")

    host: str = Field(default="127.0.0.1", description="Address to bind the HTTP server to.")
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="HTTP port; 0 = any free port.")
    orchestrator_address: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}",
                                      description="host:port of the orchestrator every request goes through.")
    call_timeout_s: float = Field(default=300.0, gt=0, description="Deadline of each orchestrator call (an invoke "
                                                                   "runs the whole workflow).")
    grace_s: float = Field(default=5.0, ge=0, description="On SIGTERM, how long in-flight requests may finish.")
    header_timeout_s: float = Field(default=30.0, gt=0, description="A connection whose request headers are not "
                                                                    "complete this long after it opened (or after "
                                                                    "its previous response; so also an idle "
                                                                    "keep-alive connection) is closed.")
    body_timeout_s: float = Field(default=30.0, gt=0, description="A request body not received within this long "
                                                                  "is answered 408 and its connection closed.")
    route_ttl_s: float = Field(default=5.0, ge=0, description="How long what a model name resolved to (its task, "
                                                             "and for streams its final stage) is kept, per "
                                                             "caller; 0 = look it up for every request.")
    tls_ca_file: str = Field(default="", description="PEM CA of the suite (flowmaker.rpc.tls): when set, the "
                                                     "orchestrator is called over TLS and verified against it. No "
                                                     "client certificate: at the orchestrator the caller's bearer "
                                                     "token is the identity.")
    log_level: str = Field(default="INFO", description="Python logging level.")

    def log_effective(self) -> None:
        log.info("gateway settings %s", json.dumps(self.model_dump(mode="json"), sort_keys=True))
