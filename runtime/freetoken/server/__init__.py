"""HTTP serving: OpenAI and Anthropic routes, health, stats and metrics over one engine."""

__all__ = ["adapters", "agent", "anthropic", "anthropic_protocol", "app", "chat_output", "config",
           "context", "errors", "launch", "metrics", "openai", "openapi", "protocol", "sse"]
