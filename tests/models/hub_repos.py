"""Repositories for the stand-in hub, made from one tiny real llama (tests/models/helpers.py) and
its GGUF files (tests/models/tiny_gguf.py), with the clutter real repositories carry: other
weight formats, images, READMEs, sidecar GGUFs, subfolders. And the huggingface_hub
environment a fresh process would see, pointed at the stand-in."""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.models.helpers import tiny_hf_model
from tests.models.tiny_gguf import write_gguf

Q4_0, Q8_0 = 2, 8
SAFETENSORS = "stand-in/tiny-llama"
SHARDED = "stand-in/tiny-llama-sharded"
GGUF = "stand-in/tiny-llama-GGUF"            # Q4_K_M (Q4_0 blocks inside), Q8_0, sidecars
GGUF_NO_DEFAULT = "stand-in/tiny-llama-Q4_0-GGUF"   # neither Q4_K_M nor Q8_0
SPLIT = "stand-in/tiny-llama-split-GGUF"     # Q8_0 in three parts
GATED = "stand-in/gated-tiny-GGUF"
GPT2 = "stand-in/tiny-gpt2"                  # an architecture FreeToken lacks (config.json)
GPT2_GGUF = "stand-in/tiny-gpt2-GGUF"        # the same, as a GGUF header says it
SPLIT_PARTS = tuple(f"tiny-llama-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3))
CLUTTER = {"README.md": b"# tiny\n", "pytorch_model.bin": b"\x80\x02pickle" * 64,
           "flax_model.msgpack": b"\x81" * 256, "onnx/model.onnx": b"onnx" * 64,
           "assets/logo.png": b"\x89PNG" + bytes(64), ".gitattributes": b"*.gguf lfs\n"}
# huggingface_hub's variables a test process may carry: cleared for every stand-in run
HF_VARIABLES = ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN",
                "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_OIDC_RESOURCE")


@dataclass(frozen=True)
class RepoSpec:
    files: dict[str, bytes]
    gated: bool = False


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _gpt2_gguf(path: Path) -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes() + bytes(1 << 20)    # a large file: its download would show


def build_repos(work: Path) -> dict[str, RepoSpec]:
    """repo id -> its files (and whether it is gated)."""
    folder = work / "tiny-llama"
    folder.mkdir()
    hf = tiny_hf_model("llama", folder)
    sharded = work / "sharded"
    hf.save_pretrained(sharded, max_shard_size="200KB")
    ggufs = work / "gguf"
    (ggufs / "split").mkdir(parents=True)
    write_gguf(hf, folder, ggufs / "q4_0.gguf", "llama", Q4_0)
    write_gguf(hf, folder, ggufs / "q8_0.gguf", "llama", Q8_0)
    write_gguf(hf, folder, ggufs / "split" / "tiny-llama-Q8_0.gguf", "llama", Q8_0,
               split_max_tensors=8)
    q4, q8 = (ggufs / "q4_0.gguf").read_bytes(), (ggufs / "q8_0.gguf").read_bytes()
    sidecar = b"GGUF" + bytes(4096)      # never fetched, so never parsed
    tokenizer = {n: (folder / n).read_bytes() for n in ("tokenizer.json",
                                                        "tokenizer_config.json")}
    model = _folder_files(folder)
    return {
        SAFETENSORS: RepoSpec({**model, **CLUTTER,
                               "original/consolidated.safetensors": model["model.safetensors"]}),
        SHARDED: RepoSpec({**_folder_files(sharded), **tokenizer, **CLUTTER,
                           "consolidated.safetensors": model["model.safetensors"]}),
        GGUF: RepoSpec({"tiny-llama-Q4_K_M.gguf": q4, "tiny-llama-Q8_0.gguf": q8,
                        "mmproj-tiny-llama-Q8_0.gguf": sidecar,
                        "tiny-llama.imatrix.gguf": sidecar, "README.md": b"# GGUF\n"}),
        GGUF_NO_DEFAULT: RepoSpec({"mmproj-tiny-llama-F16.gguf": sidecar,
                                   "tiny-llama-Q4_0.gguf": q4, "README.md": b"#\n"}),
        SPLIT: RepoSpec({**{n: (ggufs / "split" / n).read_bytes() for n in SPLIT_PARTS},
                         "README.md": b"# split\n"}),
        GATED: RepoSpec({"tiny-llama-Q8_0.gguf": q8}, gated=True),
        GPT2: RepoSpec({"config.json": b'{"architectures": ["GPT2LMHeadModel"], '
                                       b'"model_type": "gpt2"}',
                        **tokenizer, "model.safetensors": bytes(1 << 20)}),
        GPT2_GGUF: RepoSpec({"tiny-gpt2-Q8_0.gguf": _gpt2_gguf(work / "gpt2.gguf")}),
    }


def start_stand_in(repos: dict[str, RepoSpec]):
    """A started stand-in hub serving `repos`."""
    from tests.models.stand_in_hub import StandInHub

    hub = StandInHub()
    for repo_id, spec in repos.items():
        hub.add(repo_id, spec.files, spec.gated)
    return hub.start()


def closed_port_url() -> str:
    """A loopback URL nothing listens on: a Hub that cannot be reached."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def huggingface_env(**variables: str):
    """os.environ with huggingface_hub's variables set to `variables` alone, and
    huggingface_hub's constants (read when it is imported) read again from it, as a process
    started with them would see; both restored afterwards."""
    from huggingface_hub import constants

    saved = dict(os.environ)
    try:
        for name in HF_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(variables)
        importlib.reload(constants)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        importlib.reload(constants)
