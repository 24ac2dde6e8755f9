"""HF model directories: config.json, *.safetensors (sharded or not), tokenizer.json,
tokenizer_config.json / chat_template.jinja and generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from freetoken.models.config import GenerationDefaults, ModelConfig
from freetoken.models.errors import ModelFormatError
from freetoken.models.registry import config_from_hf
from freetoken.models.tokenizer import Tokenizer

_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                 "lm_head": "lm_head.weight"}
_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object from `path` ({} when optional and absent)."""
    if not path.is_file():
        if required:
            raise ModelFormatError(f"{path}: missing; an HF model directory needs config.json, "
                                   f"*.safetensors and tokenizer.json")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return value


class HFTensors:
    """Canonical-name access to a directory's safetensors (a ``TensorSource``)."""

    def __init__(self, directory: Path):
        self.source = str(directory)
        self._handles: dict[Path, Any] = {}
        self._file_of = self._index(directory)

    def _open(self, file: Path):
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ModelFormatError(f"{file}: unreadable safetensors file ({exc}); "
                                       f"it may be truncated, download it again") from None
        return self._handles[file]

    def _index(self, directory: Path) -> dict[str, Path]:
        index_file = directory / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index_file}: missing 'weight_map'")
            return {name: directory / file for name, file in weight_map.items()}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{directory}: no *.safetensors files (only safetensors "
                                   f"checkpoints are read; convert .bin/.pt weights first)")
        return {name: f for f in files for name in self._open(f).keys()}

    def file_name(self, name: str) -> str:
        if name.startswith("layers."):
            _, index, part = name.split(".", 2)
            return f"model.layers.{index}.{_LAYER_NAMES[part]}"
        return _GLOBAL_NAMES.get(name, name)

    def get(self, name: str) -> torch.Tensor | None:
        hf_name = self.file_name(name)
        file = self._file_of.get(hf_name)
        if file is None:
            return None
        if not file.is_file():
            raise ModelFormatError(f"{file}: listed in the safetensors index for {hf_name!r} "
                                   f"but missing")
        return self._open(file).get_tensor(hf_name)


def hf_generation_defaults(gen: dict[str, Any]) -> GenerationDefaults:
    """Sampling defaults from generation_config.json; do_sample=false means greedy."""
    known = ("temperature", "top_k", "top_p", "max_new_tokens", "do_sample")
    temperature = gen.get("temperature")
    if gen.get("do_sample") is False:
        temperature = 0.0
    return GenerationDefaults(
        temperature=None if temperature is None else float(temperature),
        top_k=None if gen.get("top_k") is None else int(gen["top_k"]),
        top_p=None if gen.get("top_p") is None else float(gen["top_p"]),
        max_tokens=None if gen.get("max_new_tokens") is None else int(gen["max_new_tokens"]),
        extra={k: v for k, v in gen.items() if k not in known},
    )


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


def read_hf_dir(directory: Path) -> tuple[ModelConfig, HFTensors, Tokenizer, GenerationDefaults]:
    """Everything a model directory describes; weights are read lazily through HFTensors."""
    raw = read_json(directory / "config.json")
    config = config_from_hf(raw, str(directory / "config.json"))
    gen = read_json(directory / "generation_config.json", required=False)
    tokenizer = hf_tokenizer(directory, raw, gen)
    return config, HFTensors(directory), tokenizer, hf_generation_defaults(gen)
