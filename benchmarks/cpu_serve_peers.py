"""The peers of benchmarks/cpu_serve.py, one per worker process.

    python benchmarks/cpu_serve_peers.py PEER SPEC_JSON

loads PEER (freetoken, llama_cpp or transformers), warms it up and prints `@@ready {...}`;
then each stdin line {"ids": [...], "n": N} is answered with `@@stamps [...]` (every output
token's seconds since the request started), and `null` ends it with `@@rss <peak MB>`.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


class PeerUnavailable(RuntimeError):
    """A peer cannot run here (its package is missing); the message says how to install it."""


# ---- the peers ----------------------------------------------------------------------------
# A setup loads the model, runs one tiny warm-up request and returns (run, load seconds);
# run(ids, max_tokens) returns every output token's seconds since the request started.

def setup_freetoken(spec: dict):
    import asyncio

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model

    start = time.perf_counter()
    loaded = load_model(spec["model"], device="cpu")
    # Every round repeats the same prompts: the prefix cache is off so each is prefilled, as
    # llama.cpp's is after llm.reset().
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=4096, device="cpu",
                                                     max_prefill_tokens=1024,
                                                     prefix_cache=False)).start()
    engine.warm_up()

    async def generate(ids: list[int], max_tokens: int) -> list[float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        stamps, t0 = [], time.perf_counter()
        async for out in engine.generate(ids, params):
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            stamps += [time.perf_counter() - t0] * len(out.token_ids)
        return stamps

    return (lambda ids, n: asyncio.run(generate(ids, n))), time.perf_counter() - start


def _llama_cpp_kwargs(llama_cls, threads: int) -> dict:
    """Llama() settings, each one its signature names (it takes **kwargs and drops unknown
    ones silently): flash attention on, as llama.cpp's own tools run here."""
    import inspect

    accepted = inspect.signature(llama_cls.__init__).parameters
    kwargs = dict(n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=1024,
                  n_ubatch=1024, verbose=False, seed=0)
    if "flash_attn_type" in accepted:
        kwargs["flash_attn_type"] = 1          # LLAMA_FLASH_ATTN_TYPE_ENABLED
    else:
        kwargs["flash_attn"] = True
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise PeerUnavailable(f"llama-cpp-python's Llama() takes no {unknown}; the benchmark "
                              "would run with settings it ignores")
    return kwargs


def setup_llama_cpp(spec: dict):
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise PeerUnavailable(f"llama-cpp-python is not installed ({exc}); "
                              "`pip install llama-cpp-python==0.3.36` (builds from source)") from None
    kwargs = _llama_cpp_kwargs(Llama, spec["threads"])
    start = time.perf_counter()
    llm = Llama(model_path=spec["model"], **kwargs)
    params = llm.context_params
    if not (getattr(params, "flash_attn", False) or getattr(params, "flash_attn_type", 0) == 1):
        raise PeerUnavailable("llama-cpp-python did not turn flash attention on")

    def run(ids: list[int], max_tokens: int) -> list[float]:
        llm.reset()             # no prefix reuse between runs: every prompt is prefilled
        stamps, t0 = [], time.perf_counter()
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter() - t0)
            if len(stamps) == max_tokens:
                break
        return stamps

    run(spec["prompts"]["42"][:4], 2)
    return run, time.perf_counter() - start


def setup_transformers(spec: dict):
    import torch

    try:   # imported before the load clock starts, as the other peers' packages are
        import transformers.modeling_gguf_pytorch_utils  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"transformers is not installed ({exc}); "
                              "`pip install transformers`") from None
    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    model = _transformers_model(Path(spec["model"]))

    class Stamps:
        """A generate() streamer that timestamps every new token (the first put is the prompt)."""

        def __init__(self):
            self.t0, self.times, self.prompt_seen = time.perf_counter(), [], False

        def put(self, value):
            if self.prompt_seen:
                self.times.append(time.perf_counter() - self.t0)
            self.prompt_seen = True

        def end(self):
            pass

    def run(ids: list[int], max_tokens: int) -> list[float]:
        stamps = Stamps()
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, streamer=stamps,
                           pad_token_id=0)
        return stamps.times

    run(spec["prompts"]["42"][:4], 2)
    return run, time.perf_counter() - start


def _transformers_model(path: Path):
    """float32 model from the GGUF's tensors as transformers dequantizes them (the tests'
    reference loader)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models.helpers import transformers_from_gguf

    return transformers_from_gguf(path)[0]


SETUPS = {"freetoken": setup_freetoken, "llama_cpp": setup_llama_cpp,
          "transformers": setup_transformers}


def _say(kind: str, payload) -> None:
    print(f"@@{kind} {json.dumps(payload)}", flush=True)


def worker_main(peer: str, spec_json: str) -> None:
    """Load and warm up, say `ready`, then answer one request per stdin line until `null`."""
    spec = json.loads(spec_json)
    try:
        run, load_s = SETUPS[peer](spec)
    except PeerUnavailable as exc:
        _say("unavailable", str(exc))
        return
    _say("ready", {"wall": time.time(), "load_warm_s": load_s})
    for line in sys.stdin:
        command = json.loads(line)
        if command is None:
            break
        _say("stamps", run(command["ids"], command["n"]))
    _say("rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2])
