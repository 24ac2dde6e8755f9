"""Tiny random HF checkpoints, a byte-level BPE tokenizer.json, and a paged-KV step driver."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from freetoken.models.batch import ForwardBatch, KVCache

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3,
          "def add(a, b):\n    return a + b\n", "Paris is the capital of France.",
          "numbers 12345 and 678, héllo wörld, 東京 🚀"] * 20


def write_byte_bpe(directory: Path, vocab_size: int = 300) -> int:
    """tokenizer.json + tokenizer_config.json (ChatML template); returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))
    return tok.get_vocab_size()


CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
           "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
MOE_SETTINGS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                  norm_topk_prob=False),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial norms and biases, and larger weights, so every path shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("mlp.gate.weight"):
                # a router with well-separated expert scores: 8-bit activation rounding in the
                # quantized paths must not flip which experts a token goes to
                p.copy_(2.0 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.08 * noise)


def tiny_hf_model(arch: str, directory: Path, seed: int = 0, **overrides):
    """Save a random 2-layer float32 model of `arch` with a tokenizer; return the HF model.
    MoE families get 8 experts, 2 per token, expert width 32 (MOE_SETTINGS)."""
    import transformers

    vocab = write_byte_bpe(directory)
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[arch])
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, eos_token_id=2, bos_token_id=None)
    settings.update(MOE_SETTINGS.get(arch, {}))
    settings.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**settings)
    config._attn_implementation = "eager"
    model = model_cls(config).to(torch.float32).eval()
    _perturb(model, seed)
    model.save_pretrained(directory)
    return model


def transformers_from_gguf(path: Path, with_tokenizer: bool = False):
    """(float32 transformers model, tokenizer or None) of a GGUF file, dequantized by
    transformers' own GGUF loader; the tied head is tied. ValueError if tensors do not fit.

    `from_pretrained(gguf_file=)` needs `accelerate`, so the model is built from its config and
    loaded from transformers' dequantized state dict. gguf's reader gets a plain ndarray view of
    the file meanwhile (its memmap subclass makes every tensor slice slow)."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, value):
            self._array = value.view(np.ndarray)

    original, gguf.GGUFReader = gguf.GGUFReader, PlainArrayReader
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        state = load_gguf_checkpoint(str(path), return_tensors=True,
                                     model_to_load=model)["tensors"]
        tokenizer = (AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
                     if with_tokenizer else None)
    finally:
        gguf.GGUFReader = original
    missing, unexpected = model.load_state_dict(state, strict=False)
    if not set(missing) <= {"lm_head.weight"} or unexpected:
        raise ValueError(f"{path}: transformers' tensors do not fit its model: missing "
                         f"{sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model, tokenizer


class PagedRunner:
    """Drives a model over a KV pool with scattered pages, like the engine does."""

    def __init__(self, model, num_blocks: int = 32, block_size: int = 16, seed: int = 0,
                 kv_dtype: str | None = None, table_width: int = 0):
        self.model, self.block_size = model, block_size
        # Block tables at least this wide, zero-padded as the engine's decode graphs pad them:
        # a decode step's attention splits its KV range by the table width (attention.cu
        # choose_splits), so eager steps match a graph bitwise only at the graph's width.
        self.table_width = table_width
        # hybrid models: sequence id s keeps its recurrent state in slot s
        self.kv = KVCache(model.config, num_blocks, block_size, kv_dtype or model.dtype,
                          model.arrays, num_state_slots=8)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = order.tolist()
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def _slots(self, seq: int, count: int) -> list[int]:
        pages = self.pages.setdefault(seq, [])
        start = self.lengths.get(seq, 0)
        slots = []
        for pos in range(start, start + count):
            if pos // self.block_size >= len(pages):
                pages.append(self.free.pop())
            slots.append(pages[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.lengths[seq] = start + count
        return slots

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward over (sequence id, new token ids) chunks; logits of each chunk's end
        (a torch tensor on the model's device, sharing memory with the model's output)."""
        ids, positions, slots, starts, last = [], [], [], [0], []
        for seq, tokens in chunks:
            begin = self.lengths.get(seq, 0)
            positions += range(begin, begin + len(tokens))
            slots += self._slots(seq, len(tokens))
            ids += tokens
            starts.append(len(ids))
            last.append(len(ids) - 1)
        width = max([len(self.pages[s]) for s, _ in chunks] + [self.table_width])
        tables = [self.pages[s] + [0] * (width - len(self.pages[s])) for s, _ in chunks]
        on_device = self.model.arrays.index

        def longs(values):
            return on_device(np.array(values, dtype=np.int64))

        def ints(values):
            return on_device(np.array(values, dtype=np.int32))

        batch = ForwardBatch(
            input_ids=longs(ids), positions=longs(positions), slot_mapping=longs(slots),
            block_tables=ints(tables), seq_lens=ints([self.lengths[s] for s, _ in chunks]),
            query_start_loc=ints(starts), logits_indices=longs(last),
            max_query_len=max(len(t) for _, t in chunks),
            state_slots=ints([s for s, _ in chunks]) if self.kv.num_state_slots else None)
        return torch.as_tensor(self.model.forward(batch, self.kv))


def assert_logits_close(ours, expected: torch.Tensor, config, kv_dtype: str | None = None,
                        msg: str = "") -> None:
    """Logits of our forward against transformers' float32 forward of the same weights.

    Both compute in float32, so they differ by rounding that scales with the largest logit and
    grows with the reductions on the way (hidden and MLP widths, in every layer). A float16 KV
    pool adds one float16 rounding of K and V per layer instead.
    """
    from tests.tolerances import assert_close

    ours = torch.as_tensor(ours)
    if kv_dtype == "float16":
        assert_close(ours, expected, torch.float32, compute=torch.float16,
                     terms=config.num_layers, msg=msg)
        return
    if kv_dtype == "fp8":
        # one e4m3 rounding of K and V per layer (at most half a step, 2^-4 relative), which
        # the softmax and the residual stream average: two of its eps cover it, while a wrong
        # scale or head is off by the logits' own size
        assert_close(ours, expected, torch.float32, compute="float8_e4m3fn",
                     terms=config.num_layers, ulps=2, msg=msg)
        return
    width = config.hidden_size + config.intermediate_size
    if config.linear is not None:
        # GDN: conv taps and out_proj, and a state that sums dk-wide products over the context
        lin = config.linear
        width += lin.conv_dim + lin.value_dim + lin.head_k_dim * config.max_position
    assert_close(ours, expected, torch.float32, terms=width * config.num_layers, msg=msg)


def assert_inverse_frequencies_close(ours, expected: torch.Tensor) -> None:
    """Rope frequencies base ** (-2i / d) in float32: the exponent's rounding becomes a relative
    error of eps * |ln(result)|, so the magnitude compared is |f| * (1 + |ln f|)."""
    from tests.tolerances import assert_close

    f = expected.double()
    assert_close(torch.as_tensor(ours), expected, torch.float32,
                 magnitude=f.abs() * (1 + f.abs().log().abs()))
