"""Constraints as llguidance grammars: a JSON Schema, or a tool call in the model's own dialect.

Grammars are compiled against an llguidance tokenizer built once per model from its
`tokenizers` JSON; a grammar llguidance cannot compile is a request error naming the field.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from freetoken.agent.dialect import HERMES, MISTRAL, Dialect
from freetoken.agent.request import AgentRequestError, Constraint, Tool

logger = logging.getLogger("freetoken.agent")

# Compact separators: tiny models otherwise loop on the whitespace a flexible grammar allows.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def import_llguidance():
    try:
        import llguidance
    except ImportError:
        raise AgentRequestError("constrained decoding needs the llguidance package: "
                                "pip install 'llguidance>=1.9,<2'") from None
    return llguidance


def create_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_id: int):
    """An llguidance tokenizer over the model's `tokenizers` backend, `vocab_size` wide (the
    logits' width) and ending on `eos_token_id`."""
    llguidance = import_llguidance()
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                  eos_token=eos_token_id)


def call_schema(tool: Tool, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             args_key: tool.parameters},
            "required": ["name", args_key], "additionalProperties": False}


def constraint_grammar(constraint: Constraint, dialect: Dialect,
                       marker_ids: dict[str, int]) -> str:
    """The llguidance grammar (serialized) of a json or tool constraint.

    marker_ids: ids of the dialect's markers that are single tokens (written as token
    references; other markers as text)."""
    llguidance = import_llguidance()
    if constraint.kind == "json":
        schema = dict(constraint.schema or {"type": "object"})
        schema["x-guidance"] = JSON_OPTIONS
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    schemas = [call_schema(t, dialect.args_key) for t in constraint.tools]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if dialect.name == MISTRAL:
        call = {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
    call = {**call, "x-guidance": JSON_OPTIONS}
    body = "call: %json " + json.dumps(call)
    if dialect.name == HERMES:
        start = (f"start: {_marker(dialect.call_open, marker_ids)} \"\\n\" call \"\\n\" "
                 f"{_marker(dialect.call_close, marker_ids)}")
    elif dialect.name == MISTRAL:
        start = f"start: {_marker(dialect.call_open, marker_ids)} call"
    else:
        start = "start: call"
    return llguidance.LLMatcher.grammar_from_lark(start + "\n" + body)


def _marker(text: str, marker_ids: dict[str, int]) -> str:
    if text in marker_ids:
        return f"<[{marker_ids[text]}]>"
    return json.dumps(text)


def check_grammar(grammar: str, ll_tokenizer: Any, where: str) -> None:
    """AgentRequestError naming `where` when llguidance rejects the grammar."""
    llguidance = import_llguidance()
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                             ll_tokenizer)
    if is_error:
        detail = "; ".join(messages) if messages else "unknown error"
        raise AgentRequestError(f"{where}: the grammar library cannot compile this schema: "
                                f"{detail}", where)


class GrammarMatcher:
    """An llguidance matcher behind the engine's TokenMatcher interface: consume the sampled
    token, then say which tokens may come next (a boolean row as wide as the logits)."""

    def __init__(self, grammar: str, ll_tokenizer: Any, vocab_size: int):
        import numpy as np

        llguidance = import_llguidance()
        # log_level 0: a failure is reported once through our logger, not on stderr
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        self.vocab_size = vocab_size
        self._words = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def consume(self, token_id: int) -> bool:
        """False when the token breaks the grammar (the matcher then stops constraining)."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return False
        if self.matcher.consume_token(token_id):
            return True
        logger.warning("the grammar stopped constraining this request: %s",
                       self.matcher.get_error())
        return False

    def allowed(self):
        """bool [vocab_size], or None when the grammar no longer constrains (done or failed)."""
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask

        if self.matcher.is_error():
            return None
        fill_next_token_bitmask(self.matcher, self._words, 0)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little",
                             count=self.vocab_size)
        return bits.view(bool)
