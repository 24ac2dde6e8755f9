"""Ranks 1..N-1 as spawned processes: started, sent each step, watched, stopped.

A watchdog thread waits on the workers' process sentinels and reads their heartbeats: a rank
that exits (killed, or an exception it reports) or whose heartbeat stops for the collective
timeout ends the server, with one line naming the rank and the cause. A rank that hangs inside
a step is also caught by rank 0's collective timing out (the same timeout). Workers die with
the server (PR_SET_PDEATHSIG, a closed pipe, daemon processes), so none is left behind.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Callable

from freetoken.parallel import group
from freetoken.parallel.worker import WorkerSpec, run_worker

log = logging.getLogger("freetoken.parallel")

WATCH_S = 0.5          # how often the watchdog looks
STOP_S = 10.0          # a clean stop waits this long for a worker before killing it
EXIT_GRACE_S = 15.0    # after a fault, the server process exits at the latest this much later
_BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class RankFailed(RuntimeError):
    """A rank died or hung; the message names it and the cause."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Ranks:
    """The worker processes of one tensor-parallel server, seen from rank 0."""

    def __init__(self, spec: group.GroupSpec, store: Any, workers: list[WorkerSpec]):
        ctx = mp.get_context("spawn")
        self.spec, self.store, self.size = spec, store, spec.size
        self.beats = ctx.Array("d", spec.size, lock=False)
        self.steps = ctx.Array("q", spec.size, lock=False)
        self.conns, self.procs = [], []
        self.fault: str | None = None
        self.on_fault: Callable[[str], None] | None = None
        self.exit_grace_s: float | None = EXIT_GRACE_S
        self._closing = False
        self._watchdog: threading.Thread | None = None
        for worker in workers:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(worker, child, self.beats, self.steps),
                               name=f"freetoken-tp-rank{worker.rank}", daemon=True)
            with _blas_threads(worker.threads):
                proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def while_alive(self, run: Callable[[], Any]) -> Any:
        """run() on a helper thread (it waits for the workers, e.g. joining the group),
        raising RankFailed as soon as a worker dies instead of waiting for its timeout."""
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                result["value"] = run()
            except BaseException as exc:   # noqa: BLE001 - re-raised on the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=target, name="freetoken-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_S)
            for rank, proc in enumerate(self.procs, 1):
                if thread.is_alive() and proc.exitcode is not None:
                    raise RankFailed(f"tensor-parallel rank {rank} {self._exit_cause(rank)} "
                                     f"while starting")
        if "error" in result:
            raise result["error"]
        return result["value"]

    def wait_ready(self) -> list[dict[str, Any]]:
        """Each worker's ready report; RankFailed when one dies or reports an error first."""
        infos = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            while not conn.poll():
                if not wait([conn, proc.sentinel], timeout=WATCH_S) or conn.poll():
                    continue
                proc.join(1.0)
                raise RankFailed(f"tensor-parallel rank {rank} {describe_exit(proc.exitcode)} "
                                 f"while loading")
            kind, payload = conn.recv()
            if kind == "error":
                raise RankFailed(f"tensor-parallel rank {rank} failed while loading: {payload}")
            infos.append(payload)
        return infos

    def send(self, message: tuple) -> None:
        """Every worker gets `message` (a broken pipe means a dead rank: the watchdog says
        which; the step fails here)."""
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(message)
            except OSError as exc:
                raise RankFailed(f"tensor-parallel rank {rank} is gone ({exc})") from None

    # ---- faults ----------------------------------------------------------------------------

    def watch(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="freetoken-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        while not self._closing and self.fault is None:
            ended = wait(list(sentinels), timeout=WATCH_S)
            if self._closing:
                return
            for sentinel in ended:
                rank = sentinels[sentinel]
                self.report(rank, self._exit_cause(rank))
                return
            now = time.monotonic()
            for rank in range(1, self.size):
                silent = now - self.beats[rank]
                if silent > self.spec.timeout_s:
                    self.report(rank, f"stopped responding (no heartbeat for {silent:.0f} s)")
                    return

    def _exit_cause(self, rank: int) -> str:
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        proc.join(1.0)
        try:
            if conn.poll():
                kind, payload = conn.recv()
                if kind == "error":
                    return f"failed: {payload}"
        except (OSError, EOFError):
            pass
        return describe_exit(proc.exitcode)

    def collective_failed(self, exc: BaseException) -> None:
        """Rank 0's own collective failed (a peer died or timed out): name the rank when the
        watchdog knows it, else say the collective timed out."""
        time.sleep(2 * WATCH_S)      # let the watchdog name a rank that died
        if self.fault is None:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "Dist" in type(exc).__name__ or "gloo" in detail.lower():
                self.report(0, f"saw a collective fail (a peer died, or did not answer within "
                               f"{self.spec.timeout_s:.0f} s): {detail}")
            else:   # the ranks are out of step now: the next collective could never meet
                self.report(0, f"failed a step: {type(exc).__name__}: {detail}")

    def report(self, rank: int, cause: str) -> None:
        """Once: say which rank failed and why, stop every worker, stop the server."""
        if self.fault is not None or self._closing:
            return
        self.fault = f"tensor-parallel rank {rank} {cause}; stopping the server"
        sys.stderr.write(f"freetoken: {self.fault}\n")
        sys.stderr.flush()
        self._kill()
        if self.on_fault is not None:    # serving: stop it, and exit at the latest a bit later
            if self.exit_grace_s is not None:
                timer = threading.Timer(self.exit_grace_s, os._exit, (1,))
                timer.daemon = True
                timer.start()
            self.on_fault(self.fault)

    # ---- stop ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker: ask, wait STOP_S, then kill."""
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + STOP_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        for conn in self.conns:
            conn.close()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)


class _blas_threads:
    """The BLAS/OpenMP thread counts a spawned worker starts with (it reads them at import)."""

    def __init__(self, threads: int):
        self.threads, self.saved = threads, {}

    def __enter__(self):
        if self.threads > 0:
            self.saved = {k: os.environ.get(k) for k in _BLAS_THREADS}
            os.environ.update({k: str(self.threads) for k in _BLAS_THREADS})

    def __exit__(self, *exc) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
