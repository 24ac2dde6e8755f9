"""Fixtures: tiny random HF checkpoints (one per architecture, built once per session)."""

from __future__ import annotations

import pytest

from tests.models.helpers import tiny_hf_model

ARCH_SETTINGS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 8},   # shorter than the test sequences
    # MoE: the layer mix under test (dense layers where the config asks for them)
    "qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_hidden_layers=4, decoder_sparse_step=2),
    "mixtral": {},
    "olmoe": {},
}
MOE_ARCHS = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """arch -> (directory, HF model): a saved random model and its tokenizer files."""
    built = {}

    def get(arch: str):
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = (directory, tiny_hf_model(arch, directory, **ARCH_SETTINGS[arch]))
        return built[arch]

    return get
