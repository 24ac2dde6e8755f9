"""A tiny random Qwen3_5MoeForConditionalGeneration (small text part, two vision blocks of
width 64, but the real patch 16 / temporal patch 2 / merge 2) saved with save_pretrained, also
as a folder to serve (Qwen's special tokens, an image-aware chat template, Qwen3.5's
preprocessor_config.json), and ImageInputs made by transformers' own image processor.
`arch="qwen3_vl"` builds a Qwen3VLForConditionalGeneration instead: a dense qwen3 text part
with full rotary, and three vision blocks of which two feed DeepStack features;
`arch="qwen3_vl_moe"` its Qwen3VLMoeForConditionalGeneration twin (routed experts in three of
the four layers)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from freetoken.vision.inputs import ImageInput
from tests.models.helpers import _perturb, write_byte_bpe
from tests.models.vl_tokenizer import SPECIALS, printable_ascii, write_vl_tokenizer
from tests.vision.images import QWEN35_PREPROCESSOR

TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-3,
            tie_word_embeddings=False, eos_token_id=2, bos_token_id=None,
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            # rotary over 16 of 32 dims: 8 frequencies, interleaved t/h/w by [3, 3, 2]
            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.5, mrope_section=[3, 3, 2],
                                 mrope_interleaved=True))
# Qwen3-VL: dense MLPs, every layer full attention, rotary over all 32 dims (16 frequencies,
# interleaved t/h/w by [6, 5, 5]), a rope base of its own
TEXT_VL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
               rms_norm_eps=1e-3, eos_token_id=2, bos_token_id=None,
               rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                    mrope_section=[6, 5, 5], mrope_interleaved=True))
# 2 * moe_intermediate_size != hidden_size: the released checkpoints' transposed expert layout
# is told apart by shape
TEXT_VL_MOE = {**TEXT_VL, "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [2]}
VISION = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=64,
              num_position_embeddings=64, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, hidden_act="gelu_pytorch_tanh")
# blocks 0 and 2 feed text layers 0 and 1
VISION_VL = {**VISION, "depth": 3, "deepstack_visual_indexes": [0, 2]}
ARCHES = ("qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe")
# config class, model class, text and vision settings of each
_CLASSES = {"qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", TEXT,
                            VISION),
            "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", TEXT_VL, VISION_VL),
            "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                             TEXT_VL_MOE, VISION_VL)}
# placeholder ids inside the byte-BPE vocabulary (their strings do not matter to the engine)
IDS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=288,
           vision_end_token_id=289)
MIN_PIXELS, MAX_PIXELS = 32 * 32, 256 * 256
SERVED_SPECIALS = [*SPECIALS, "<|video_pad|>"]


def build_vision_model(directory, seed: int = 0, text=None, vision=None,
                       arch: str = "qwen3_5_moe"):
    """Save a random float32 vision-language model with a tokenizer; return the HF model."""
    return _save_model(directory, write_byte_bpe(directory), IDS, seed, text, vision, arch)


def build_served_vision_model(directory, seed: int = 0, arch: str = "qwen3_5_moe"):
    """The tiny model as a folder to serve: a tokenizer with Qwen's chat and image specials
    (the config's placeholder ids are theirs) whose every token is printable ASCII, a chat
    template that renders image items, Qwen3.5's preprocessor_config.json and greedy-neutral
    generation settings ending at <|im_end|>. Returns the special tokens' ids."""
    specials = write_vl_tokenizer(directory, printable_ascii(), SERVED_SPECIALS)
    vocab = max(specials.values()) + 1
    ids = dict(image_token_id=specials["<|image_pad|>"],
               video_token_id=specials["<|video_pad|>"],
               vision_start_token_id=specials["<|vision_start|>"],
               vision_end_token_id=specials["<|vision_end|>"])
    eos = specials["<|im_end|>"]
    _save_model(directory, vocab, ids, seed, dict(eos_token_id=eos, max_position_embeddings=1024),
                None, arch)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN35_PREPROCESSOR))
    return specials


def _save_model(directory, vocab: int, ids: dict, seed: int, text, vision, arch: str):
    import transformers

    torch.manual_seed(seed)
    config_name, model_name, text_base, vision_base = _CLASSES[arch]
    config = getattr(transformers, config_name)(
        text_config={**text_base, "vocab_size": vocab, **(text or {})},
        vision_config={**vision_base, **(vision or {})}, tie_word_embeddings=False, **ids)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    _perturb(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv1d.weight"):
                p.mul_(6.0)
            elif name.endswith("A_log"):
                p.copy_(torch.linspace(-2.0, 1.0, p.numel()))
    model.save_pretrained(directory)
    return model


def image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """The HF processor Qwen3.5 checkpoints name (Qwen2-VL's, with patch 16)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                 size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def random_pixels(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def make_image(pixels: np.ndarray, processor=None) -> ImageInput:
    """An ImageInput exactly as the HF processor prepares `pixels` (uint8 HxWx3)."""
    out = (processor or image_processor())(images=[pixels], return_tensors="np")
    grid = tuple(int(g) for g in out["image_grid_thw"][0])
    return ImageInput(np.asarray(out["pixel_values"], dtype=np.float32), grid,
                      hashlib.sha256(pixels.tobytes()).hexdigest())


def expand_prompt(text_ids: list[list[int]], images: list[ImageInput], merge: int = 2
                  ) -> list[int]:
    """text_ids[0] <image 0> text_ids[1] <image 1> ... with each image as vision_start,
    its placeholders and vision_end (what the server renders)."""
    out = list(text_ids[0])
    for image, after in zip(images, text_ids[1:]):
        out += [IDS["vision_start_token_id"]]
        out += [IDS["image_token_id"]] * image.num_tokens(merge)
        out += [IDS["vision_end_token_id"]] + list(after)
    return out


def hf_inputs(prompt: list[int], images: list[ImageInput]) -> dict:
    """transformers' forward arguments for a prompt and its images."""
    ids = torch.tensor([prompt])
    kwargs = {"input_ids": ids,
              "mm_token_type_ids": (ids == IDS["image_token_id"]).int()}
    if images:
        kwargs["pixel_values"] = torch.from_numpy(np.concatenate([i.pixel_values for i in images]))
        kwargs["image_grid_thw"] = torch.tensor([i.grid_thw for i in images])
    return kwargs
