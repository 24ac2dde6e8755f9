"""HF tokenizers: tokenizer.json plus tokenizer_config.json's special tokens and the chat
template (chat_template.jinja first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freetoken.models.checkpoint.json_file import read_json
from freetoken.models.errors import ModelFormatError
from freetoken.models.tokenizer.core import Tokenizer


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):   # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return () if value is None else (int(value),)


def hf_tokenizer(directory: Path, config: dict[str, Any], gen: dict[str, Any]) -> Tokenizer:
    """The directory's tokenizer.json plus special tokens and chat template."""
    from tokenizers import Tokenizer as Backend

    file = directory / "tokenizer.json"
    if not file.is_file():
        raise ModelFormatError(f"{file}: missing; the model directory needs tokenizer.json")
    try:
        backend = Backend.from_file(str(file))
    except Exception as exc:   # tokenizers raises a bare Exception on bad JSON
        raise ModelFormatError(f"{file}: unreadable tokenizer ({exc})") from None
    tok_config = read_json(directory / "tokenizer_config.json", required=False)
    special = {k: _token_text(tok_config.get(k))
               for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
    if bos_id is None:
        bos_id = config.get("bos_token_id")
    eos_from_text = backend.token_to_id(special["eos_token"]) if special["eos_token"] else None
    eos = _ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id")) + _ids(eos_from_text)
    return Tokenizer(backend, chat_template=_chat_template(directory, tok_config),
                     bos_token_id=bos_id, eos_token_ids=eos, special_tokens=special)
