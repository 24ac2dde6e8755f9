"""Images on the GPU: time to encode one 1024x1024 image and time to first token for a short
prompt with it, FreeToken beside transformers on the same weights in the same run.

    python benchmarks/gpu_vision.py [--depth 27] [--size 1024] [--out results/gpu-vision.json]

The vision tower is Qwen3.5/3.6's (width 1152, 16 heads of 72, MLP 4304, 2304 learned
positions, `--depth` blocks: 27 as released) with random bf16 weights; the text part is small
(4 layers, width 1024, 16 experts) so the first token measures the image path. The image is
preprocessed once by transformers' Qwen2-VL image processor with Qwen3.5's pixel limits (a
1024x1024 image keeps its size: 4096 patches, 1024 tokens); both sides start from those
pixel values. FreeToken: `VisionTower.encode`, and `Engine.generate` to the first streamed
token (prefix and encoder caches defeated by a fresh digest per run). transformers:
`get_image_features`, and one forward over the prompt with the image (sdpa attention).
Each figure is the median of `--reps` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

try:   # the hub `kernels` package transformers may import, before the repository root (whose
    import kernels  # noqa: F401  kernels/ folder has that name) joins sys.path
except ImportError:
    pass

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VISION = dict(hidden_size=1152, num_heads=16, intermediate_size=4304,
              num_position_embeddings=2304, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, hidden_act="gelu_pytorch_tanh")
TEXT = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=128, max_position_embeddings=8192, linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
            linear_num_value_heads=8, num_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=512, shared_expert_intermediate_size=512,
            layer_types=["linear_attention", "linear_attention", "linear_attention",
                         "full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                 partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                                 mrope_interleaved=True))
PIXELS = dict(shortest_edge=65536, longest_edge=16777216)   # Qwen3.5's preprocessor limits


def build(directory: Path, depth: int):
    """A random bf16 Qwen3_5MoeForConditionalGeneration saved to `directory`."""
    import transformers

    from tests.models.helpers import write_byte_bpe
    from tests.models.vision_checkpoint import IDS

    vocab = write_byte_bpe(directory)
    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeConfig(
        text_config={**TEXT, "vocab_size": vocab}, tie_word_embeddings=False,
        vision_config={**VISION, "depth": depth, "out_hidden_size": TEXT["hidden_size"]}, **IDS)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(
        {"size": PIXELS, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}))
    return model.cuda().eval()


def timed(fn, reps: int) -> float:
    """Median seconds of `fn` after one warm-up call (synchronised around each call)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def freetoken_ttft(directory: Path, prompt, image, reps: int) -> tuple[float, float]:
    """(encode seconds, first-token seconds) through FreeToken's tower and engine."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model

    loaded = load_model(str(directory), device="cuda", dtype="bfloat16")
    encode = timed(lambda: loaded.vision.tower.encode([image]), reps)
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=8192,
                                                     max_prefill_tokens=2048)).start()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    counter = iter(range(1 << 30))

    async def first_token() -> float:
        fresh = replace(image, digest=f"{image.digest}-{next(counter)}")   # no cache hits
        start = time.perf_counter()
        async for _ in engine.generate(prompt, params, images=[fresh]):
            return time.perf_counter() - start
        raise RuntimeError("no output")

    try:
        ttft = [asyncio.run(first_token()) for _ in range(reps + 1)][1:]
    finally:
        engine.shutdown()
    return encode, statistics.median(ttft)


def transformers_ttft(hf, prompt, image, reps: int) -> tuple[float, float]:
    from tests.models.vision_checkpoint import hf_inputs

    inputs = {k: v.cuda() for k, v in hf_inputs(prompt, [image]).items()}
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    with torch.inference_mode():
        encode = timed(lambda: hf.model.get_image_features(inputs["pixel_values"],
                                                           inputs["image_grid_thw"]), reps)
        ttft = timed(lambda: hf(**inputs, logits_to_keep=1).logits.argmax(-1).item(), reps)
    return encode, ttft


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=27)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/gpu-vision.json"))
    args = p.parse_args()
    from tests.models.vision_checkpoint import (expand_prompt, image_processor, make_image,
                                                random_pixels)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        hf = build(directory, args.depth)
        processor = image_processor(PIXELS["shortest_edge"], PIXELS["longest_edge"])
        image = make_image(random_pixels(args.size, args.size, 0), processor)
        prompt = expand_prompt([[10, 11, 12, 13], [20, 21, 22, 23, 24, 25]], [image])
        ours = freetoken_ttft(directory, prompt, image, args.reps)
        theirs = transformers_ttft(hf, prompt, image, args.reps)
    result = {"gpu": torch.cuda.get_device_name(), "depth": args.depth,
              "image": [args.size, args.size], "grid_thw": list(image.grid_thw),
              "image_tokens": image.num_tokens(2), "prompt_tokens": len(prompt),
              "freetoken": {"encode_ms": ours[0] * 1e3, "ttft_ms": ours[1] * 1e3},
              "transformers": {"encode_ms": theirs[0] * 1e3, "ttft_ms": theirs[1] * 1e3}}
    print(f"{result['gpu']}: {args.size}x{args.size} image, grid {image.grid_thw}, "
          f"{result['image_tokens']} image tokens, vision depth {args.depth}")
    print(f"{'':14}{'encode ms':>12}{'TTFT ms':>12}")
    for name in ("freetoken", "transformers"):
        row = result[name]
        print(f"{name:14}{row['encode_ms']:12.1f}{row['ttft_ms']:12.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
