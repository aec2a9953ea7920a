"""Settings of workflow generation (env prefix FLOWMAKER_GENERATOR_): which generator, and how to reach its LLM."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class GeneratorSettings(BaseSettings):
    """With `llm_base_url` empty (the default) candidates come from the built-in template
    library; with it set, from the LLM behind that OpenAI-compatible endpoint."""

    model_config = SettingsConfigDict(env_prefix="FLOWMAKER_GENERATOR_", extra="ignore")

    llm_base_url: str = Field(default="", description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000 or "
                                             "https://api.example.com/v1; empty: use the template library")
    llm_model: str = Field(default="", description="model name sent in each request; required with llm_base_url")
    llm_api_key: SecretStr = Field(default=SecretStr(""), description="sent as 'Authorization: Bearer <key>' when set")
    llm_timeout_s: float = Field(default=60.0, gt=0, description="per-request timeout, connection to last byte")
    llm_max_attempts: int = Field(default=3, ge=1, le=10, description="requests per generation, retries included")
    llm_max_tokens: int = Field(default=4096, ge=256, description="max_tokens of each answer")
    llm_temperature: float = Field(default=0.0, ge=0, le=2, description="0 keeps answers as repeatable as the server allows")
    max_candidates: int = Field(default=3, ge=1, le=10, description="candidates asked for when a request does not say")
