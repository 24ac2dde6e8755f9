"""The end-of-run checks of benchmarks/serve_soak.py, each a pure function of what the run
recorded, so a test can feed them a broken run:

- counts: the client's tally of outcomes equals the server's own counters (/v1/stats finish
  reasons and refusals, /metrics responses by route and status), taken as differences from
  before the run, so every accepted request ended once, as the client saw it end;
- expected: every request ended as its kind should (soak_requests.EXPECTED);
- memory: the server's RSS (and on a GPU its allocated VRAM) at the end is within a tolerance
  of its level after the warm-up;
- log: no ERROR line or traceback in the server's log but the injected faults';
- idle: the server is back to idle: no request running or waiting, no KV page (or recurrent
  state slot) held.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from benchmarks.soak_requests import ROUTES, Outcome

FINISHED = ("stop", "length", "abort", "error")
REFUSED = ("queue_full", "shutting_down")
STATUS_LINE = re.compile(r'^freetoken_requests_total\{route="([^"]+)",status="(\d+)"\} (\S+)$')


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class ServerCounts:
    """The server's counters at one moment."""

    finished: dict[str, int]          # finish reason -> requests
    refused: int                      # refused at admission (503/529), any reason
    statuses: dict[tuple[str, int], int]   # (route, HTTP status) -> responses, our routes only

    @classmethod
    def read(cls, stats: dict, metrics_text: str) -> "ServerCounts":
        statuses = {}
        for line in metrics_text.splitlines():
            if (m := STATUS_LINE.match(line)) and m.group(1) in ROUTES.values():
                statuses[(m.group(1), int(m.group(2)))] = int(float(m.group(3)))
        return cls({r: int(stats.get(f"requests_finished_{r}", 0)) for r in FINISHED},
                   sum(int(stats.get(f"requests_refused_{r}", 0)) for r in REFUSED), statuses)

    def minus(self, before: "ServerCounts") -> "ServerCounts":
        keys = set(self.statuses) | set(before.statuses)
        return ServerCounts(
            {r: self.finished[r] - before.finished[r] for r in FINISHED},
            self.refused - before.refused,
            {k: self.statuses.get(k, 0) - before.statuses.get(k, 0) for k in keys
             if self.statuses.get(k, 0) != before.statuses.get(k, 0)})


def client_view(outcomes: list[Outcome]) -> ServerCounts:
    """What the server's counters should have moved by, from the client's outcomes."""
    tally = Counter(o.outcome for o in outcomes)
    finished = {"stop": 0, "length": tally["completed"], "abort": tally["cancelled"],
                "error": tally["failed"]}
    statuses = Counter((o.request.route, o.status) for o in outcomes if o.status is not None)
    return ServerCounts(finished, tally["refused"], dict(statuses))


def check_counts(outcomes: list[Outcome], delta: ServerCounts | None) -> Check:
    """Client and server agree on every accepted request's end (completed = stop + length:
    the client does not tell the two apart) and on every response's route and status.
    `delta`: what the server's counters moved by (None: it did not answer)."""
    if delta is None:
        return Check("counts", False, "the server did not answer /v1/stats and /metrics")
    want = client_view(outcomes)
    got = {"completed": delta.finished["stop"] + delta.finished["length"],
           "cancelled (abort)": delta.finished["abort"], "failed (error)": delta.finished["error"],
           "refused": delta.refused}
    expect = {"completed": want.finished["length"], "cancelled (abort)": want.finished["abort"],
              "failed (error)": want.finished["error"], "refused": want.refused}
    problems = [f"{name}: client {expect[name]}, server {got[name]}" for name in got
                if got[name] != expect[name]]
    for key in sorted(set(want.statuses) | set(delta.statuses)):
        if want.statuses.get(key, 0) != delta.statuses.get(key, 0):
            problems.append(f"{key[0]} HTTP {key[1]}: client {want.statuses.get(key, 0)}, "
                            f"server {delta.statuses.get(key, 0)}")
    accepted = sum(expect[k] for k in ("completed", "cancelled (abort)", "failed (error)"))
    summary = (f"{accepted} accepted requests ended ({expect['completed']} completed, "
               f"{expect['cancelled (abort)']} cancelled, {expect['failed (error)']} failed), "
               f"{expect['refused']} refused; responses by route and status agree")
    return Check("counts", not problems, "; ".join(problems) or summary)


def check_expected(outcomes: list[Outcome]) -> Check:
    wrong = [o for o in outcomes if not o.expected]
    if not wrong:
        return Check("expected", True, f"all {len(outcomes)} requests ended as their kind should")
    kinds = Counter(f"{o.request.kind} -> {o.outcome}" for o in wrong)
    first = wrong[0]
    return Check("expected", False,
                 f"{len(wrong)} requests ended unexpectedly ({dict(kinds)}); e.g. request "
                 f"{first.request.index} ({first.request.kind} on {first.request.route}, HTTP "
                 f"{first.status}): {first.detail}")


def check_growth(name: str, baseline: float | None, final: float | None, tolerance: float,
                 unit: str = "MiB", scale: float = 1 / 2**20) -> Check:
    """`final` at most `tolerance` (a fraction) above `baseline`; skipped (ok) where it is
    not measured, failed where it was but no longer can be (the server went away)."""
    if baseline is None:
        return Check(name, True, "not measured")
    if final is None:
        return Check(name, False, f"{baseline * scale:.1f} {unit} after warm-up, unreadable "
                                  "at the end")
    growth = (final - baseline) / baseline if baseline else 0.0
    text = (f"{baseline * scale:.1f} {unit} after warm-up, {final * scale:.1f} {unit} at the "
            f"end ({growth:+.1%}; limit +{tolerance:.0%})")
    return Check(name, growth <= tolerance, text)


def check_log(text: str | None, allowed: str = "injected fault") -> Check:
    """No ERROR line or traceback in `text` but those about `allowed` (a traceback is allowed
    when its last line names `allowed`); skipped (ok) without a log."""
    if text is None:
        return Check("log", True, "no server log to read")
    bad, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("Traceback"):
            end = i + 1
            while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end]):
                end += 1
            last = lines[end] if end < len(lines) else ""
            if allowed not in last:
                bad.append(f"traceback ending {last.strip()[:160]!r}")
            i = end + 1
            continue
        if "ERROR" in line and allowed not in line:
            bad.append(line.strip()[:200])
        i += 1
    allowed_count = sum(allowed in line for line in lines)
    if bad:
        return Check("log", False, f"{len(bad)} unexpected: " + " | ".join(bad[:3]))
    return Check("log", True, f"no errors but {allowed_count} lines about the {allowed}s")


def check_idle(stats: dict | None) -> Check:
    if stats is None:
        return Check("idle", False, "the server did not answer /v1/stats")
    held = {k: stats.get(k, 0) for k in ("running", "waiting", "kv_pages_used",
                                          "state_slots_used")}
    busy = {k: v for k, v in held.items() if v}
    if busy:
        return Check("idle", False, f"still held at the end: {busy}")
    return Check("idle", True, "no request running or waiting, no KV page held "
                               f"({stats.get('kv_pages_cached', 0)} cached for reuse)")
