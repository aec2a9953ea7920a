"""FlowMaker: a control plane that serves multi-step LLM applications at least cost within their SLOs."""

import os as _os

# gRPC's fork handlers (on by default) can block fork() for good when another thread is inside gRPC, which
# hangs a process that starts children (the launcher, its supervisor, the tests' stacks). FlowMaker never
# uses gRPC in a forked child (every child execs at once), so they are turned off before grpc is imported.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
