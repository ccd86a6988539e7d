"""The gateway: the OpenAI-compatible front door, composing the engine, policies and telemetry."""
