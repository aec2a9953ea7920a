"""Workflow-variant selection: strategies looked up by name, all searching the space of spec/selection.md."""

from __future__ import annotations

from flowmaker.selection.registry import STRATEGIES, get_strategy, select

__all__ = ["STRATEGIES", "get_strategy", "select"]
