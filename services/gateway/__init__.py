"""The OpenAI-compatible HTTP front door: tasks as models, chat completions run through the orchestrator."""
