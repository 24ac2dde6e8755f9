"""HTTP serving: OpenAI and Anthropic routes, health, stats and metrics over one engine."""

__all__ = ["anthropic", "app", "config", "context", "errors", "launch", "metrics", "openai",
           "protocol", "sse"]
