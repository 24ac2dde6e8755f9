"""Agent support shared by every protocol: tool-call and thinking dialects, the streaming output
parser, prompts with tools, and constraints as llguidance grammars."""

__all__ = ["dialect", "grammar", "parser", "prompt", "request"]
