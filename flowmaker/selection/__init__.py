"""Workflow-variant selection: strategies looked up by name, all searching the space of spec/selection.md."""

from __future__ import annotations

from flowmaker import native

native.install()  # before the strategies import their modules: the compiled class search where it is built

from flowmaker.selection.registry import STRATEGIES, get_strategy, select  # noqa: E402 (after the hook)

__all__ = ["STRATEGIES", "get_strategy", "select"]
