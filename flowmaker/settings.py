"""Typed settings shared by every service: a pydantic-settings base class read from FLOWMAKER_<SVC>_* variables.

Each service subclasses `ServiceSettings` with its own env prefix (the only place a service
reads the environment) and adds its own fields; `log_effective()` logs the result once.
"""

from __future__ import annotations

import json
import logging

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)

# Default ports when a service is run on its own; tests and `flowmaker up` may use 0 (any free port).
DEFAULT_PORTS = {"generator": 50051, "profiler": 50052, "selector": 50053, "deployer": 50054, "orchestrator": 50055}


class ServiceSettings(BaseSettings):
    """Settings every service has. Subclass with `model_config = settings_config("deployer")`."""

    model_config = SettingsConfigDict(env_prefix="FLOWMAKER_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address to bind the gRPC server to.")
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 = any free port (the bound one is logged).")
    etcd_endpoints: str = Field(default="127.0.0.1:2379", description="Comma-separated etcd client endpoints (host:port).")
    etcd_namespace: str = Field(default="", description="Prefix prepended to every etcd key (isolates stacks sharing one etcd).")
    etcd_timeout_s: float = Field(default=5.0, gt=0, description="Deadline of each etcd call; past it etcd counts as unavailable.")
    grace_s: float = Field(default=5.0, ge=0, description="On SIGTERM, how long in-flight RPCs may finish before they are cancelled.")
    call_timeout_s: float = Field(default=30.0, gt=0, description="Default deadline of outgoing gRPC calls.")
    log_level: str = Field(default="INFO", description="Python logging level.")
    # mTLS (flowmaker.rpc.tls): all three set = TLS on the listener and on every channel this service opens;
    # all empty = plaintext (local debugging: `flowmaker up --insecure`), logged as a warning.
    tls_ca_file: str = Field(default="", description="PEM CA that signs the suite's certificates (peers are verified "
                                                     "against it).")
    tls_cert_file: str = Field(default="", description="PEM certificate of this service (its identity is the common "
                                                       "name).")
    tls_key_file: str = Field(default="", description="PEM private key of tls_cert_file.")
    etcd_tls: bool = Field(default=False, description="Dial etcd over mTLS with this service's certificate "
                                                      "(tls_* files; etcd started with --client-cert-auth).")
    etcd_user: str = Field(default="", description="etcd user to log in as (etcd auth, flowmaker.state.etcd_auth: one "
                                                   "per service); empty = no etcd login.")
    etcd_password_file: str = Field(default="", description="File holding etcd_user's password (0600); a path, "
                                                            "never the password.")
    engine_key_secret_file: str = Field(default="", description="Secret sealing the engines' API keys in instance "
                                                                "records (deployer and orchestrator only); empty = "
                                                                "stored as given.")
    auth_tokens_file: str = Field(default="", description="JSON {token: {user, admin}} of bearer tokens the public "
                                                          "API accepts (orchestrator).")
    metrics_port: int = Field(default=-1, ge=-1, le=65535, description="Prometheus /metrics port (on `host`); "
                                                                       "-1 = off, 0 = any free port.")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in logging.getLevelNamesMapping():
            raise ValueError(f"unknown log level {v!r}")
        return v

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_ca_file and self.tls_cert_file and self.tls_key_file)

    @model_validator(mode="after")
    def _tls_all_or_none(self) -> ServiceSettings:
        given = [bool(self.tls_ca_file), bool(self.tls_cert_file), bool(self.tls_key_file)]
        if any(given) and not all(given):
            raise ValueError("tls_ca_file, tls_cert_file and tls_key_file go together (all set or none)")
        if self.etcd_tls and not all(given):
            raise ValueError("etcd_tls needs tls_ca_file, tls_cert_file and tls_key_file")
        if bool(self.etcd_user) != bool(self.etcd_password_file):
            raise ValueError("etcd_user and etcd_password_file go together (both set or neither)")
        return self

    @property
    def etcd_endpoint_list(self) -> list[str]:
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log_effective(self, service: str) -> None:
        """One line with every effective setting (they hold no secrets: TLS keys and tokens are file paths)."""
        log.info("%s settings %s", service, json.dumps(self.model_dump(mode="json"), sort_keys=True))


def settings_config(service: str) -> SettingsConfigDict:
    """The model_config of a service's settings class: prefix FLOWMAKER_<SVC>_, unknown variables ignored."""
    return SettingsConfigDict(env_prefix=f"FLOWMAKER_{service.upper()}_", extra="ignore")
