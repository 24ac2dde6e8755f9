"""The engine: one background thread runs scheduling steps; asyncio callers submit and stream."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from freetoken import env
from freetoken.engine.admission import AdmissionGate, check_request
from freetoken.engine.config import (EngineConfig, EngineConfigError, resolve_engine_config,
                                     resolve_kv_dtype)
from freetoken.engine.detokenizer import IncrementalDetokenizer
from freetoken.engine.faults import RequestFault, has_fault_marker, raise_injected_faults
from freetoken.engine.guide import Guide, apply_guides
from freetoken.engine.kv_pool import PagePool
from freetoken.engine.live_resize import ResizeBusy, apply_resize
from freetoken.engine.logprobs import log_softmax_rows, token_logprob
from freetoken.engine.overlap_steps import OverlapSteps
from freetoken.engine.penalties import apply_penalties
from freetoken.engine.prepare import prepare_forward_batch
from freetoken.engine.request import (FINISH_REASONS, Request, RequestOutput, RequestRejected,
                                      SamplingParams, Usage)
from freetoken.engine.sampling import create_generator, sample_tokens
from freetoken.engine.scheduler import ScheduledChunk, Scheduler
from freetoken.engine.speculative_steps import SpeculativeSteps
from freetoken.engine.state_pool import StateSlots
from freetoken.engine.state_rollback import SavedStates
from freetoken.engine.state_snapshots import SNAPSHOTS_PER_SLOT, StateSnapshots
from freetoken.engine.stats import settings_stats
from freetoken.engine.stream import RequestStream, batched_delivery
from freetoken.engine.vision_setup import attach_vision, check_images, warm_up_vision
from freetoken.models.batch import ForwardBatch, KVCache

if TYPE_CHECKING:
    from freetoken.engine.offload_setup import OffloadDecision
    from freetoken.models.config import GenerationDefaults
    from freetoken.vision.inputs import ImageInput, VisionPreprocess

logger = logging.getLogger("freetoken.engine")


class EngineDead(RuntimeError):
    """The engine thread is not running (never started, shut down, or crashed)."""


class Engine(OverlapSteps, SpeculativeSteps):
    """Serves one model: paged KV pool, continuous batching, sampling, streamed outputs.

    Args:
        model: has .config (ModelConfig), .arrays (HostArrays or TorchArrays: its device),
            .dtype and .forward(ForwardBatch, KVCache) -> float32 logits [B, vocab].
        tokenizer: has decode(ids, skip_special_tokens=True) -> str.
        config: engine settings; "auto" values are resolved against the model's context.
        generation_defaults: the model's sampling defaults (used when
            config.sampling_defaults == "model" and a request leaves a field unset).
        eos_token_ids: ids that end a sequence with finish_reason "stop".
        model_id: names the weights in prefix-cache keys (with the shape and KV dtype).
        offload: the start-up memory plan's decision (KV pool size, expert offload), if any.
        vision: the model's VisionModel (models/vision_model.py) when it takes images.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig,
                 generation_defaults: GenerationDefaults | None = None,
                 eos_token_ids: Sequence[int] = (), model_id: str = "",
                 offload: OffloadDecision | None = None, vision: Any = None):
        self.model = model
        self._vision = vision
        self.model_id = model_id
        self.tokenizer = tokenizer
        if offload is not None:
            config = replace(config, num_tokens=offload.num_tokens)
        self.config = resolve_engine_config(config, model.config.max_position)
        self.generation_defaults = generation_defaults
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pool = PagePool(self.config.num_blocks, self.config.block_size)
        self.arrays = model.arrays
        self.kv_dtype = resolve_kv_dtype(self.config.kv_dtype, self.arrays.device.is_cpu,
                                         model.dtype)
        if self.kv_dtype == "fp8" and getattr(model, "tensor_parallel_size", 1) > 1:
            raise EngineConfigError("--kv-dtype fp8 is not available with tensor parallelism "
                                    "yet; use --kv-dtype auto")
        self.states = None
        if getattr(model.config, "linear", None) is not None:
            self.states = StateSlots(self.config.max_num_seqs, KVCache.bytes_per_state_slot(
                model.config, model.dtype))
        self.kv = KVCache(model.config, self.config.num_blocks, self.config.block_size,
                          self.kv_dtype, self.arrays,
                          num_state_slots=self.states.num_slots if self.states else 0,
                          state_dtype=model.dtype)
        self.scheduler = Scheduler(self.config, self.pool,
                                   f"{model_id}|{model.config!r}|{self.kv_dtype}", self.states)
        if self.states is not None and self.config.prefix_cache:
            self.scheduler.snapshots = StateSnapshots(
                self.kv, [i for i in range(model.config.num_layers)
                          if model.config.is_linear(i)],
                SNAPSHOTS_PER_SLOT * self.states.num_slots, self.arrays)
        if hasattr(model, "reserve"):  # size work buffers for the largest step up front
            model.reserve(self.config.max_prefill_tokens + self.config.max_num_seqs)
        self.rope_spare, self.encoder_cache = 0, None
        if vision is not None:
            self.rope_spare, self.encoder_cache = attach_vision(
                model, vision, self.config.max_prefill_tokens + self.config.max_num_seqs)
        self.memory_plan = offload.plan if offload is not None else None   # the start-up plan
        self.expert_cache = None
        if offload is not None and offload.offloaded:
            from freetoken.engine.offload_setup import attach_expert_cache

            self.expert_cache = attach_expert_cache(model, offload)
        self._set_up_speculation(model)   # engine/speculative_steps.py
        # An offloaded model learns each MoE layer's routing on the host mid-step: its decode
        # graphs are segments replayed around that (engine/segment_graphs.py).
        self.graphs = None
        if not self.arrays.device.is_cpu and self.config.cuda_graphs:
            self.graphs = self.recapture_graphs()
        # Overlap scheduling (engine/overlap.py): only where the forward runs asynchronously.
        # An offloaded model learns expert misses on the host mid-step, so it keeps
        # synchronous steps (a hybrid model's state snapshots are copied before the next step
        # is launched: see Scheduler.schedule_decodes). Tests set it on the CPU, where it runs
        # the same logic synchronously. Tensor parallelism neither: the other ranks never see
        # the ids rank 0 samples on its GPU.
        # Speculation neither: a step's drafts follow from the step before's tokens; only
        # `auto`'s plain steps overlap, where its governor measured drafting slower.
        self.overlap = (self.config.overlap and not self.arrays.device.is_cpu
                        and self.expert_cache is None
                        and (self.drafter is None or self.scheduler.governor is not None)
                        and vision is None
                        and getattr(model, "tensor_parallel_size", 1) == 1)
        self._plain_resolved_at: float | None = None   # overlapped steps' timing (auto)
        self._jobs: list = []   # (future, kv_tokens, moe_rate, states): run between steps
        self._requests: dict[str, Request] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.admission = AdmissionGate(self.config.max_num_seqs, self.config.max_queued_requests)
        self.fault_marker = env.read().fault_marker   # tests: see engine/faults.py
        self._counters = {"prompt_tokens": 0, "tokens_generated": 0, "requests_finished": 0,
                          "steps": 0, **{f"requests_finished_{r}": 0 for r in FINISH_REASONS}}

    @classmethod
    def from_loaded(cls, loaded: Any, config: EngineConfig,
                    offload: OffloadDecision | None = None) -> Engine:
        """An engine for a freetoken.models.loader.LoadedModel."""
        eos = tuple(loaded.tokenizer.eos_token_ids) + tuple(loaded.config.eos_token_ids)
        return cls(loaded.model, loaded.tokenizer, config, loaded.generation_defaults, eos,
                   f"{loaded.name}|{loaded.source}", offload, getattr(loaded, "vision", None))

    @property
    def vision(self) -> VisionPreprocess | None:
        """How this model wants its images preprocessed; None when it takes no images."""
        return None if self._vision is None else self._vision.preprocess

    def recapture_graphs(self):
        """Decode CUDA graphs over the current KV pool and expert pool (again after a resize),
        and the MTP block's where it drafts; None when an offloaded model's capture fails (it
        then decodes eagerly)."""
        from freetoken.engine.segment_graphs import capture_decode_graphs

        max_blocks = -(-self.max_request_tokens // self.config.block_size)
        if hasattr(self.model, "decode_graphs"):   # tensor parallelism: every rank captures
            return self.model.decode_graphs(self.kv, self.config.max_num_seqs, max_blocks)
        if self.mtp is not None:   # the MTP block's steps after decode and verify steps
            self.mtp.capture_graphs(self.config.max_num_seqs, max_blocks,
                                    self.config.max_prefill_tokens + self.config.max_num_seqs)
        return capture_decode_graphs(self.model, self.kv, self.config.max_num_seqs, max_blocks,
                                     self.expert_cache, self._verify_graph_shape())

    def resize_pools(self, kv_tokens: int | None = None, moe_rate: float | None = None,
                     wait: float = 0.0, states: int | None = None) -> dict[str, Any]:
        """Resize the KV pool (tokens), the expert cache (rate) and a hybrid model's state
        pool (slots) between two steps; a shrink past pages or slots in use waits up to `wait`
        seconds for them. Returns the new pool stats; raises MemoryPlanError, ResizeBusy or
        ValueError, the old pools serving on."""
        deadline = time.monotonic() + wait
        while True:
            job: Future = Future()
            with self._cond:
                if not self.is_alive:
                    raise EngineDead("the engine is not running; restart the server")
                self._jobs.append((job, kv_tokens, moe_rate, states))
                self._cond.notify()
            try:
                return job.result()
            except ResizeBusy:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.05)

    def _run_jobs(self) -> None:
        """Pending resizes, on the engine thread between two steps (lock held)."""
        jobs, self._jobs = self._jobs, []
        for job, kv_tokens, moe_rate, states in jobs:
            try:
                job.set_result(apply_resize(self, kv_tokens, moe_rate, states))
            except Exception as exc:   # noqa: BLE001 - the caller gets it
                job.set_exception(exc)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="freetoken-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop the thread; every request still in flight ends with finish_reason "abort"."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.abort_all("the engine shut down")
        with self._cond:
            for job, *_ in self._jobs:
                job.set_exception(EngineDead("the engine shut down before the resize ran"))
            self._jobs = []

    def warm_up(self) -> None:
        """Run one two-token request so every kernel is loaded (or compiled) before serving;
        raises RuntimeError when it fails. The counters start from zero afterwards."""
        async def run() -> RequestOutput:
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            return [out async for out in self.generate([0], params)][-1]

        last = asyncio.run(run())
        if last.finish_reason == "error":
            raise RuntimeError(f"the warm-up request failed: {last.error}")
        if self._vision is not None:
            warm_up_vision(self._vision)
        with self._cond:
            self._counters = dict.fromkeys(self._counters, 0)
            self.scheduler.cache_queried_tokens = self.scheduler.cache_hit_tokens = 0

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stop_admission(self) -> None:
        """Refuse new requests (AdmissionRefused) while those inside run on: shutdown's
        first step."""
        with self._cond:
            self.admission.close()

    @property
    def num_in_engine(self) -> int:
        """Requests accepted and not ended yet (running or waiting)."""
        with self._cond:
            return len(self._requests)

    @property
    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request may use: the context or the whole pool."""
        return min(self.model.config.max_position, self.pool.num_pages * self.pool.block_size)

    # ---- requests --------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None, guide: Guide | None = None,
               images: Sequence[ImageInput] = ()) -> RequestStream:
        """Queue a request; call inside a running event loop and iterate the returned stream.
        `guide` restricts the tokens it may sample (a grammar, a thinking budget). `images`
        are the prompt's images in order: each occupies vision_start, num_tokens(merge)
        image placeholders and vision_end in the prompt.

        Raises RequestRejected (prompt empty, out of vocabulary, or too long with max_tokens;
        images the model cannot take or that do not match the placeholders) before anything
        is queued, AdmissionRefused when the waiting queue is full or the engine is shutting
        down, and EngineDead when the engine is not running.
        """
        request_id = request_id or uuid.uuid4().hex
        prompt = [int(t) for t in prompt_ids]
        resolved = self._resolve_params(prompt, params)
        layout = check_images(prompt, images, self._vision, self.model_id.split("|")[0]
                              or self.model.config.architecture)
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.abort)
        request = Request(
            request_id=request_id, prompt_len=len(prompt), token_ids=prompt, params=resolved,
            generator=create_generator(resolved.seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, resolved.stop),
            sink=stream.put, guide=guide.start() if guide is not None else None, mm=layout,
            inject_fault=has_fault_marker(self.tokenizer, prompt, self.fault_marker))
        with self._cond:
            if not self.is_alive:
                raise EngineDead("the engine is not running; restart the server")
            self.admission.admit(len(self._requests))
            if request_id in self._requests:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self._requests[request_id] = request
            self._counters["prompt_tokens"] += len(prompt)
            self.scheduler.add(request)
            self._cond.notify()
        return stream

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, images: Sequence[ImageInput] = ()
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request."""
        stream = self.submit(prompt_ids, params, request_id, images=images)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> bool:
        """End a request now with finish_reason "abort" and free its KV pages; False if unknown."""
        with self._cond:
            request = self._requests.get(request_id)
            if request is None:
                return False
            self._end(request, "abort", request.detokenizer.finish())
            return True

    def abort_all(self, reason: str) -> None:
        """End every request inside with finish_reason "abort" and `reason` as its error, so
        each stream still gets its last event (shutdown, once the grace period is over)."""
        with self._cond:
            for request in list(self._requests.values()):
                self._end(request, "abort", "", error=reason)

    def stats(self) -> dict[str, Any]:
        """A snapshot for /v1/stats and the metrics gauges."""
        with self._cond:
            stats = {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_pages_used": self.pool.num_used,
                "kv_pages_total": self.pool.num_pages,
                "kv_block_size": self.pool.block_size,
                "kv_occupancy": self.pool.occupancy,
                "preemptions": self.scheduler.num_preemptions,
                "prefix_cache": self.config.prefix_cache,
                "prefix_cache_queried_tokens": self.scheduler.cache_queried_tokens,
                "prefix_cache_hit_tokens": self.scheduler.cache_hit_tokens,
                "prefix_cache_evictions": self.pool.num_evictions,
                "kv_pages_cached": self.pool.num_cached,
                "kv_pages_idle": self.pool.num_idle,
                **(self.states.stats() if self.states else {}),
                **(self.scheduler.snapshots.stats() if self.scheduler.snapshots else {}),
                **(self.encoder_cache.stats() if self.encoder_cache else {}),
                **self._counters,
                **self.admission.stats(),
                **(self.drafter.stats.as_dict() if self.drafter else {}),
                **(self.scheduler.governor.as_dict() if self.scheduler.governor else {}),
            }
        stats.update(settings_stats(self))
        return stats

    def _resolve_params(self, prompt: list[int], params: SamplingParams) -> SamplingParams:
        limit = self.max_request_tokens
        detail = (f"this server allows {limit} tokens per request (context "
                  f"{self.model.config.max_position}, KV pool "
                  f"{self.pool.num_pages * self.pool.block_size})")
        check_request(prompt, params, limit, self.model.config.vocab_size, detail)
        use_model = self.config.sampling_defaults == "model"
        return params.resolve(self.generation_defaults if use_model else None,
                              limit - len(prompt))

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            in_flight = None
            while True:
                if in_flight is None:
                    if (work := self._next_step()) is None:
                        return
                    if not self._overlaps(work[0]):
                        self._step(*work)
                        continue
                    in_flight = self._launch(*work)
                else:
                    in_flight = self._advance(in_flight)
        except BaseException:
            logger.exception("the engine thread crashed")
            with self._cond:
                self._stopping = True
                for request in list(self._requests.values()):
                    self._end(request, "error", "", error="the engine thread crashed")
                for job, *_ in self._jobs:
                    job.set_exception(EngineDead("the engine thread crashed"))
                self._jobs = []
            raise

    def _next_step(self) -> tuple[list[ScheduledChunk], ForwardBatch] | None:
        """Wait for work; the plan and batch of the next step, or None when stopping."""
        with self._cond:
            while True:
                while not self._stopping and not self.scheduler.has_work and not self._jobs:
                    self._cond.wait()
                if self._stopping:
                    return None
                self._run_jobs()
                if not self.scheduler.has_work:
                    continue
                plan = self.scheduler.schedule()
                if plan:
                    return plan, prepare_forward_batch(plan, self.pool.block_size,
                                                       self.arrays, self.states is not None,
                                                       self.rope_spare)
                self._cond.wait(0.01)  # NOTE: nothing fits yet; not expected to happen

    def _step(self, plan: list[ScheduledChunk], batch: ForwardBatch) -> None:
        # The forward runs without the lock, so submit/abort/stats never wait for it.
        mark = self._speed_mark(plan)   # --speculative auto times its decode steps
        if self.expert_cache is not None:   # prompt chunks stream whole expert layers
            # (a verify step's drafts go through the cache as decode tokens do)
            self.expert_cache.prefill = any(c.num_tokens != 1 + len(c.draft) for c in plan)
        with batched_delivery():  # the step's outputs reach each event loop in one wake-up
            try:
                if self.fault_marker:
                    raise_injected_faults(plan)
                if batch.multimodal is not None:   # image embeddings for this step's chunks
                    self.encoder_cache.fill(batch.multimodal)
                saved = self._save_drafting_states(plan)
                with self.arrays.no_grad():
                    logits = self._forward(plan, batch)
                with self._cond:
                    self._process(plan, logits, saved)
                if mark is not None:
                    self._record_speed(plan, *mark)
            except RequestFault as exc:   # only its requests end; the rest run again
                logger.error("engine step failed: %s", exc)
                self._fail([c for c in plan if c.request in exc.requests],
                           f"model step failed: {exc}")
            except Exception as exc:  # a failed step fails its requests, not the server
                logger.exception("engine step failed")
                self._fail(plan, f"model step failed: {exc}")
        with self._cond:
            if not self.scheduler.has_work:
                self.pool.check_integrity(self.scheduler.owned_pages())

    def _forward(self, plan: list[ScheduledChunk], batch: ForwardBatch) -> Any:
        """The step's logits: from a decode or verify CUDA graph where one takes the step,
        else from an eager forward."""
        graphs = self.graphs
        if graphs is not None and batch.multimodal is None:
            if graphs.can_run(batch):
                return graphs.run(batch)
            if batch.max_query_len > 1 and graphs.verify_sizes \
                    and all(c.num_tokens == 1 + len(c.draft) for c in plan):
                drafts = [len(c.draft) for c in plan]
                longest = max(c.request.num_computed + c.num_tokens for c in plan)
                if graphs.can_verify(drafts, longest, batch):
                    return graphs.run_verify(drafts, batch)
        return self.model.forward(batch, self.kv)

    def _process(self, plan: list[ScheduledChunk], logits: Any,
                 saved: SavedStates | None = None) -> None:
        self._counters["steps"] += 1
        first_rows, row = [], 0   # each chunk's first row of logits: a verify step has 1 + K
        for chunk in plan:
            first_rows.append(row)
            row += 1 + len(chunk.draft)
        live = [i for i, chunk in enumerate(plan) if not chunk.request.is_finished]
        to_sample = [i for i in live if plan[i].completes_sequence and not plan[i].draft]
        for i in live:
            if not plan[i].draft:
                plan[i].request.num_computed += plan[i].num_tokens
                self.scheduler.publish(plan[i].request)
        verifying = [i for i in live if plan[i].draft]
        replay, accepted = [], {}
        if verifying:
            replay, accepted = self._verify([plan[i] for i in verifying], logits,
                                            [first_rows[i] for i in verifying])
        self._sample(plan, logits, to_sample, first_rows)
        # the MTP block runs only while its drafts are wanted (the auto governor's call)
        block = (self._block_rows(plan, accepted)
                 if self.mtp is not None and self.scheduler.drafting else [])
        hidden = self.mtp.take_hidden(block) if block else None
        if replay:
            self._replay(replay, saved)
        for i in verifying:
            if not plan[i].request.is_finished:
                self.scheduler.publish(plan[i].request)
                self.scheduler.trim_pages(plan[i].request)
        if block:
            ready = [part.request for part in block if part.request.num_pending == 1
                     and part.request.draft_state is not None]
            with self.arrays.no_grad():
                self.mtp.step(block, hidden, self.pool, ready)

    def _sample(self, plan: list[ScheduledChunk], logits: Any, to_sample: list[int],
                first_rows: list[int]) -> None:
        """Sample the next token of every chunk in `to_sample` (no drafts) and append it."""
        if not to_sample:
            return
        requests = [plan[i].request for i in to_sample]
        if len(to_sample) < logits.shape[0]:
            logits = logits[[first_rows[i] for i in to_sample]]
        asking = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        with self.arrays.no_grad():
            log_probs = log_softmax_rows(logits, asking) if asking else None
            apply_penalties(logits, requests)
            if any(r.guide is not None for r in requests):
                apply_guides(logits, [r.guide for r in requests])
            tokens = sample_tokens(logits, [r.params for r in requests],
                                   [r.generator for r in requests])
        entries: list = [None] * len(requests)
        for slot, i in enumerate(asking):
            entries[i] = token_logprob(log_probs[slot], tokens[i], requests[i].params.logprobs)
        for request, token, entry in zip(requests, tokens, entries):
            self._append_token(request, token, entry)

    def _append_token(self, request: Request, token: int, entry=None,
                      index: int | None = None) -> None:
        """Add a sampled token (or, with `index`, fill the placeholder there: later ones may
        follow it), stream it and end the request on EOS, a stop string or max_tokens."""
        if index is None:
            request.token_ids.append(token)
            index = len(request.token_ids) - 1
        else:
            request.token_ids[index] = token
        num_output = index + 1 - request.prompt_len
        if request.guide is not None:
            request.guide.accept(token)
        self._counters["tokens_generated"] += 1
        logprobs = None if entry is None else [entry]
        if token in self.eos_token_ids and not request.params.ignore_eos:
            self._end(request, "stop", request.detokenizer.finish(), token, stop_reason=token,
                      logprobs=logprobs)
            return
        text = request.detokenizer.push(token)
        if request.detokenizer.matched_stop is not None:
            self._end(request, "stop", text, token, stop_reason=request.detokenizer.matched_stop,
                      logprobs=logprobs)
        elif num_output >= request.params.max_tokens:
            self._end(request, "length", text + request.detokenizer.finish(), token,
                      logprobs=logprobs)
        else:
            usage = Usage(request.prompt_len, num_output, request.cached_tokens or 0)
            request.sink(RequestOutput(request.request_id, [token], text, None, usage,
                                       logprobs=logprobs))

    def _end(self, request: Request, reason: str, text: str, token: int | None = None,
             stop_reason: str | int | None = None, error: str | None = None,
             logprobs: list | None = None) -> None:
        """Terminal output + free pages; called with the lock held."""
        while request.token_ids and request.token_ids[-1] < 0:   # tokens of steps in flight,
            request.token_ids.pop()                               # dropped (engine/overlap.py)
        self.scheduler.finish(request)
        self._requests.pop(request.request_id, None)
        self._counters["requests_finished"] += 1
        self._counters[f"requests_finished_{reason}"] += 1
        request.sink(RequestOutput(request.request_id, [] if token is None else [token], text,
                                   reason, request.usage(),
                                   stop_reason, error, logprobs))

    def _fail(self, plan: list[ScheduledChunk], message: str) -> None:
        with self._cond:
            for chunk in plan:
                if not chunk.request.is_finished:
                    self._end(chunk.request, "error", "", error=message)
