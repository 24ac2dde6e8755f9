"""What a bfloat16 forward of a random transformers model is measured against.

Rounding a random model's weights to bfloat16 alone can move its logits by O(1): on the real
vision width with the small hybrid text part, float32 compute over the bf16-rounded weights is
2.2 away from float32 over the float32 weights (logits of magnitude 4), because the rounding
flips near-tied expert choices in the first layers and the random layers amplify the change.
Any bf16 server runs the rounded weights, so the reference is transformers in float32 over
exactly those weights, and the yardstick is transformers' own bf16 forward against it: ours
may differ from the reference by at most twice what transformers' bf16 run does, plus a few
bf16 roundings of the logits' magnitude. Expert choices that flip differ between any two bf16
implementations, so (as in test_gpu_vs_hf for MoE) the rule holds for the mean over several
prompts, not for each one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from tests.tolerances import eps


def bf16_twins(hf: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model in bfloat16, the model in float32 holding the bf16-rounded weights).

    Only the parameters are rounded: ``.to(bfloat16)`` would also round the rotary
    frequencies (buffers), which a bf16 server keeps in float32."""
    low = copy.deepcopy(hf).to(torch.bfloat16).eval()
    rounded = copy.deepcopy(hf).eval()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16))
    return low, rounded


@dataclass
class Bf16Errors:
    """Max logit errors against the float32-over-bf16-weights reference, one row per prompt."""

    ours: list[float] = field(default_factory=list)
    theirs: list[float] = field(default_factory=list)     # transformers' bf16 run
    magnitude: float = 0.0

    def add(self, ours: torch.Tensor, theirs: torch.Tensor, ref: torch.Tensor) -> None:
        ref = ref.float().cpu()
        self.ours.append((ours.float().cpu() - ref).abs().max().item())
        self.theirs.append((theirs.float().cpu() - ref).abs().max().item())
        self.magnitude = max(self.magnitude, ref.abs().max().item())

    def bound(self, ulps: float = 4.0) -> float:
        """Twice transformers' mean bf16 error plus `ulps` bf16 roundings of the logits."""
        mean = sum(self.theirs) / len(self.theirs)
        return 2.0 * mean + ulps * eps(torch.bfloat16) * self.magnitude

    def check(self) -> None:
        mean = sum(self.ours) / len(self.ours)
        assert mean <= self.bound(), (
            f"mean max-logit error {mean:.4g} over {len(self.ours)} prompts exceeds "
            f"{self.bound():.4g} (transformers' own bf16 errors {self.theirs}, ours {self.ours},"
            f" logits' magnitude {self.magnitude:.3g})")
