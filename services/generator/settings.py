"""Settings of the generator service (env prefix FLOWMAKER_GENERATOR_): the common service settings plus
the generator's own (`flowmaker.generator.settings.GeneratorSettings`: LLM endpoint, model, key, timeout)."""

from __future__ import annotations

from flowmaker.generator.settings import GeneratorSettings
from flowmaker.settings import ServiceSettings, settings_config


class GeneratorServiceSettings(ServiceSettings, GeneratorSettings):
    """Everything `python -m services.generator` reads from the environment."""

    model_config = settings_config("generator")
