"""Local stack launcher: a real etcd plus the five services as subprocesses on loopback (`flowmaker up`, demo, e2e)."""

from flowmaker.launcher.stack import SERVICES, LocalStack, StackConfig, StackError, free_port

__all__ = ["SERVICES", "LocalStack", "StackConfig", "StackError", "free_port"]
