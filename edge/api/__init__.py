"""The edge daemon's HTTP API: OpenAI-compatible completions and chat completions, health, metrics."""
