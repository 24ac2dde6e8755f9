"""A worker that raises reports its exception: the watchdog names the rank and the cause once,
and the worker process is gone."""

from __future__ import annotations

import time

from tests.models.helpers import tiny_hf_model


def test_a_worker_exception_is_named(tmp_path):
    from freetoken.parallel.options import ParallelConfig
    from freetoken.parallel.start import start_sharded

    tiny_hf_model("qwen3", tmp_path, seed=2)
    loaded = start_sharded(str(tmp_path), "auto", ParallelConfig(2, ("cpu", "cpu")),
                           preload=False)
    ranks, seen = loaded.model.ranks, []
    ranks.exit_grace_s, ranks.on_fault = None, seen.append   # no process exit in a test
    try:
        ranks.send(("no-such-message",))
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.1)
        assert seen == ["tensor-parallel rank 1 failed: RuntimeError: unknown message "
                        "'no-such-message' from rank 0; stopping the server"]
        assert not ranks.procs[0].is_alive()
    finally:
        loaded.model.close()


def test_a_collective_no_rank_answers_times_out_and_is_named(tmp_path, monkeypatch):
    import numpy as np
    import pytest

    from freetoken.parallel.options import ParallelConfig
    from freetoken.parallel.start import start_sharded

    monkeypatch.setenv("FREETOKEN_TP_TIMEOUT", "2")
    tiny_hf_model("qwen3", tmp_path, seed=2)
    loaded = start_sharded(str(tmp_path), "auto", ParallelConfig(2, ("cpu", "cpu")),
                           preload=False)
    model, seen = loaded.model, []
    model.ranks.exit_grace_s, model.ranks.on_fault = None, seen.append
    try:
        start = time.monotonic()
        # rank 0 alone in an all-reduce: the worker waits for a step that never comes
        with pytest.raises(RuntimeError):
            model._call(model.rank.comm.all_reduce, np.zeros(4, dtype=np.float32))
        assert time.monotonic() - start < 2 + 5
        assert len(seen) == 1 and seen[0].startswith(
            "tensor-parallel rank 0 saw a collective fail (a peer died, or did not answer "
            "within 2 s)"), seen
    finally:
        model.close()
