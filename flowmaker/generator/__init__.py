"""Workflow generation: a task description in, validated candidate workflows out (template library or LLM)."""

from flowmaker.generator.base import Generator, TemplateGenerator, make_generator
from flowmaker.generator.settings import GeneratorSettings
from flowmaker.generator.templates import TemplateFamily, classify, families, generate_from_templates

__all__ = ["Generator", "GeneratorSettings", "TemplateFamily", "TemplateGenerator", "classify", "families",
           "generate_from_templates", "make_generator"]
