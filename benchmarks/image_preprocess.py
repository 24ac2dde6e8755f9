"""Host-side cost of one image input, beside transformers' image processor in the same run.

For each size: the encoded bytes (PNG and JPEG of random pixels, the worst case for PNG) go
through freetoken.vision (decode with Pillow, smart_resize, bicubic resize, rescale, normalize,
patches) and through transformers' Qwen2VLImageProcessorPil on the image Pillow decodes from
the same bytes (decode timed too). Qwen3.5/3.6 settings; medians of N runs.

    python benchmarks/image_preprocess.py [--repeats 7] [--sizes 256,1024,2048]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", default="256,1024,2048")
    args = parser.parse_args()

    import numpy as np
    from PIL import Image, ImageOps
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    from freetoken.vision.inputs import VisionPreprocess
    from freetoken.vision.preprocess import preprocess_bytes

    config = VisionPreprocess(16, 2, 2, 65536, 16777216, (0.5,) * 3, (0.5,) * 3,
                              "<|image_pad|>", 0, 0, 0)
    hf = Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216},
                                  patch_size=16, temporal_patch_size=2, merge_size=2,
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3)
    rng = np.random.default_rng(0)
    print(f"{'image':>16} {'tokens':>7} {'freetoken ms':>13} {'transformers ms':>16}")
    for side in (int(s) for s in args.sizes.split(",")):
        pixels = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        for fmt in ("PNG", "JPEG"):
            buffer = io.BytesIO()
            pixels.save(buffer, format=fmt)
            data = buffer.getvalue()
            ours = preprocess_bytes(data, config)
            ref = lambda: hf(images=[ImageOps.exif_transpose(Image.open(io.BytesIO(data)))],
                             return_tensors="np")
            print(f"{f'{side}x{side} {fmt}':>16} {ours.num_tokens(2):>7} "
                  f"{median_ms(lambda: preprocess_bytes(data, config), args.repeats):>13.1f} "
                  f"{median_ms(ref, args.repeats):>16.1f}")


if __name__ == "__main__":
    main()
