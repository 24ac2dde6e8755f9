"""Run llama.cpp's own HF -> GGUF converter on a random-weight folder (a child process of
convert.py: the converter imports its own `gguf` from the staged sources).

Usage: python benchmarks/llama_cpp_cuda/converter_hook.py SRC_DIR HF_DIR OUT.gguf OUTTYPE

The converter reads the vocabulary through transformers and recognizes the pre-tokenizer by
hashing what it makes of a test text, which only real tokenizers pass. The model class it picks
is replaced by a subclass whose `set_vocab` writes the placeholder vocabulary of vocab.py at the
config's size; everything else (tensor names, layouts, metadata) is the converter's. A folder
without MTP weights is converted with MTP export off (what `--no-mtp` does).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _vocab_size(hparams: dict) -> int:
    size = hparams.get("vocab_size") or (hparams.get("text_config") or {}).get("vocab_size")
    if not size:
        raise SystemExit("config.json names no vocab_size")
    return int(size)


def _has_mtp_weights(folder: Path) -> bool:
    """Whether any safetensors file of `folder` holds an `mtp.` tensor (headers only)."""
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        if any(".mtp." in f".{name}" for name in header):
            return True
    return False


def main() -> None:
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    src, hf_dir, out, outtype = sys.argv[1:]
    # this folder's modules (paths, build, bench, ...) must not shadow any the converter imports
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import conversion  # noqa: E402  (llama.cpp's converter package, from the staged sources)

    # appended, not first: the repository's kernels/ folder must not shadow the `kernels`
    # package transformers may import
    sys.path.append(str(REPO))
    from benchmarks.llama_cpp_cuda.vocab import add_placeholder_vocab

    pick = conversion.get_model_class
    mtp = _has_mtp_weights(Path(hf_dir))

    def with_placeholder_vocab(name, *args, **kwargs):
        base = pick(name, *args, **kwargs)

        def set_vocab(self) -> None:
            add_placeholder_vocab(self.gguf_writer, _vocab_size(self.hparams))

        # ModelBase insists every subclass names its architecture itself
        attrs = {"set_vocab": set_vocab, "model_arch": base.model_arch}
        if getattr(base, "supports_mtp_export", False) and not mtp:
            attrs["no_mtp"] = True
        return type(base.__name__, (base,), attrs)

    conversion.get_model_class = with_placeholder_vocab
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype]
    runpy.run_path(str(Path(src) / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
