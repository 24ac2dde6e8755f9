"""The served model's agent support: its dialect, the prompt of an AgentRequest, the output
parser and the decoding guide (grammar, thinking budget) of each request."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from freetoken.agent.dialect import Dialect, detect_dialect
from freetoken.agent.grammar import (GrammarMatcher, check_grammar, constraint_grammar,
                                     create_ll_tokenizer, import_llguidance)
from freetoken.agent.parser import OutputParser
from freetoken.agent.prompt import opens_thinking, template_inputs
from freetoken.agent.request import AgentRequest, AgentRequestError
from freetoken.engine.guide import Guide, ThinkRule


@dataclass
class PreparedChat:
    """A chat request ready to submit: its prompt, a fresh output parser (None: the text is the
    content as is) and its guide (None: plain sampling)."""

    prompt_ids: list[int]
    parser: OutputParser | None
    guide: Guide | None


class AgentSupport:
    """Built once per served model; `prepare` turns an AgentRequest into a PreparedChat."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True) if hasattr(
            tokenizer, "backend") else {}
        self.dialect: Dialect = detect_dialect(tokenizer.chat_template, vocab)
        # NOTE: llguidance treats every added token as special (its text never matches a
        # string literal), so a marker that is one token is referenced by id in grammars.
        markers = (self.dialect.call_open, self.dialect.call_close)
        self.marker_ids = {m: vocab[m] for m in markers if m in vocab}

    @functools.cached_property
    def ll_tokenizer(self):
        return create_ll_tokenizer(self.tokenizer, self.vocab_size,
                                   self.tokenizer.eos_token_ids[0])

    def render(self, request: AgentRequest) -> tuple[str, list[int]]:
        """The prompt text and ids; a template that fails is a 400 on `messages`."""
        from freetoken.models.errors import ChatTemplateError

        messages, kwargs = template_inputs(request, self.dialect)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      **kwargs)
        except ChatTemplateError as exc:
            raise AgentRequestError(f"the chat template failed: {exc}", "messages") from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def prepare(self, request: AgentRequest, max_tokens: int | None) -> PreparedChat:
        for i, tool in enumerate(request.tools):
            self.check_schema(tool.parameters, f"tools.{i}")
        text, ids = self.render(request)
        in_thinking = opens_thinking(text, self.dialect)
        parser = None
        if self.dialect.think_open or request.tools_active:
            names = {t.name for t in request.tools} if request.tools_active else None
            parser = OutputParser(self.dialect, names, in_thinking,
                                  None if request.parallel_calls else 1)
        matcher = None
        if request.constraint.kind != "none":
            where = "tool_choice" if request.constraint.kind == "tool" else "response_format"
            grammar = constraint_grammar(request.constraint, self.dialect, self.marker_ids)
            self.check_grammar(grammar, where)
            matcher = GrammarMatcher(grammar, self.ll_tokenizer, self.vocab_size)
        think = self.think_rule(request, in_thinking, max_tokens, matcher is not None)
        guide = Guide(matcher, think) if (matcher is not None or think is not None) else None
        return PreparedChat(ids, parser, guide)

    def think_rule(self, request: AgentRequest, in_thinking: bool, max_tokens: int | None,
                   constrained: bool) -> ThinkRule | None:
        """The thinking rule: a budget (the request's, else half of max_tokens) and, with a
        grammar, where reasoning ends and the constrained answer starts."""
        if not self.dialect.think_open or (request.thinking is False and not in_thinking):
            return None
        open_id = self.tokenizer.token_id(self.dialect.think_open)
        close_id = self.tokenizer.token_id(self.dialect.think_close)
        if close_id is None:
            return None
        budget = request.thinking_budget
        if budget is None and max_tokens is not None:
            budget = max(1, max_tokens // 2)
        if budget is None and not constrained:
            return None
        close_ids = tuple(self.tokenizer.encode("\n", add_special_tokens=False)) + (close_id,)
        return ThinkRule(open_id, close_ids, budget, in_thinking)

    def check_schema(self, schema: dict, where: str) -> None:
        _check_cached(self, json.dumps(schema, sort_keys=True), where)

    def check_grammar(self, grammar: str, where: str) -> None:
        check_grammar(grammar, self.ll_tokenizer, where)


@functools.lru_cache(maxsize=256)
def _check_cached(support: AgentSupport, schema_json: str, where: str) -> None:
    llguidance = import_llguidance()
    schema = json.loads(schema_json)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    support.check_grammar(grammar, where)
