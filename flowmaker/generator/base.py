"""The Generator interface (task description -> candidate workflows), the template implementation and the factory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from flowmaker.cancel import offload
from flowmaker.domain import Workflow
from flowmaker.generator.settings import GeneratorSettings
from flowmaker.generator.templates import generate_from_templates

if TYPE_CHECKING:
    import aiohttp


@runtime_checkable
class Generator(Protocol):
    """Proposes candidate workflows for a task description; every one passes `Workflow.validate()`."""

    name: str  # "templates" or "llm"; shown in logs and in the service's response

    async def generate(self, description: str, max_candidates: int = 3) -> tuple[Workflow, ...]: ...

    async def close(self) -> None: ...


class TemplateGenerator:
    """The built-in template library behind the Generator interface: no I/O, deterministic."""

    name = "templates"

    async def generate(self, description: str, max_candidates: int = 3) -> tuple[Workflow, ...]:
        # Classifying a description is CPU work proportional to its length: off the event loop.
        return await offload(generate_from_templates, description, max_candidates)

    async def close(self) -> None:
        return None


def make_generator(settings: GeneratorSettings | None = None, *,
                   session: aiohttp.ClientSession | None = None) -> Generator:
    """The LLM generator when an endpoint is configured (`llm_base_url`), else the template library."""
    s = settings if settings is not None else GeneratorSettings()
    if s.llm_base_url:
        from flowmaker.generator.llm import LlmGenerator

        return LlmGenerator(s, session=session)
    return TemplateGenerator()
