"""FlowMaker: a control plane that serves multi-step LLM applications at least cost within their SLOs."""

__version__ = "0.1.0"
