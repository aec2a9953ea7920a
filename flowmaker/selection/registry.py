"""Registry of selection strategies: `select(request, strategy)` is the one entry point."""

from __future__ import annotations

from collections.abc import Callable

from flowmaker.domain import CapacityModel, SelectionRequest, SelectionResult
from flowmaker.errors import InvalidSpec
from flowmaker.selection.stackroom import with_room

Strategy = Callable[[SelectionRequest], SelectionResult]

STRATEGIES: dict[str, Strategy] = {}


def register(name: str) -> Callable[[Strategy], Strategy]:
    def deco(fn: Strategy) -> Strategy:
        STRATEGIES[name] = fn
        return fn
    return deco


def get_strategy(name: str) -> Strategy:
    _load()
    try:
        return STRATEGIES[name]
    except KeyError:  # a misspelt option, not a missing resource: INVALID_ARGUMENT (AIP-193)
        raise InvalidSpec(f"unknown selection strategy {name!r}; known: {sorted(STRATEGIES)}",
                       field="strategy", reason="UNKNOWN_STRATEGY") from None


def select(request: SelectionRequest, strategy: str = "exact") -> SelectionResult:
    """Validate the request and run the named strategy on it."""
    fn = get_strategy(strategy)
    request.validate()
    # (the searches recurse: from a frame that leaves their recursion one stack chunk, `stackroom`)
    if request.options.capacity_model is CapacityModel.BUSY_TIME:
        from flowmaker.selection.busytime import select_busy_time
        return with_room(select_busy_time, request, strategy, fn)
    return with_room(fn, request)


def _load() -> None:
    # Import the strategy modules for their @register side effect (kept lazy so
    # that importing the registry never pulls optional extras such as skopt).
    from flowmaker.selection import bayesopt, exact, exhaustive, heuristic, milp  # noqa: F401
