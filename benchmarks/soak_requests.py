"""The requests of a soak run (benchmarks/serve_soak.py) and how each one ended, as the client
saw it.

A request is one of KINDS: a valid request of each protocol, streamed or not; an invalid one
(a value of the wrong JSON type, expected to be refused with 400); a stream the client leaves
after a few events ("cancel"); or one whose prompt carries the server's fault marker
(FREETOKEN_FAULT_MARKER), expected to fail with a 500 or, once streaming, an error event.
Every request ends with exactly one OUTCOME; one outside its kind's EXPECTED set is a failure.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
          "messages": "/v1/messages"}
# kind -> its default weight in the mix
KINDS = {"chat": 1, "chat_stream": 2, "completion": 1, "completion_stream": 1, "messages": 1,
         "messages_stream": 1, "invalid": 2, "cancel": 2, "fault": 1}
OUTCOMES = ("completed", "rejected", "failed", "cancelled", "refused", "unexpected")
VALID = frozenset({"completed", "refused"})
EXPECTED = {**{kind: VALID for kind in KINDS},
            "invalid": frozenset({"rejected"}),
            # a stream may end on its own before the client leaves it (EOS on /v1/messages)
            "cancel": frozenset({"cancelled", "completed", "refused"}),
            "fault": frozenset({"failed", "refused"})}
FAULT_TEXT = "injected fault"      # what the server's message says about an injected fault
WORDS = ("river stone light morning garden quiet paper window music winter summer market "
         "bridge forest letter orange silver cloud harbor lantern").split()
# Bodies of the wrong JSON type for each protocol: the server must answer 400.
INVALID = {
    "chat": [{"max_tokens": "ten"}, {"temperature": "1"}, {"stream": 0}, {"seed": True},
             {"messages": "hello"}, {"unknown_field": 1}],
    "completion": [{"prompt": [[False]]}, {"max_tokens": "4"}, {"top_p": "x"},
                   {"stream": "yes"}],
    "messages": [{"stream": 0}, {"max_tokens": "4"}, {"messages": []},
                 {"temperature": "0.5"}],
}


@dataclass(frozen=True)
class SoakRequest:
    """One request: its kind, protocol, body, and (cancel) after how many events to leave."""

    index: int
    kind: str
    api: str              # "chat" | "completion" | "messages"
    body: dict
    leave_after: int = 0  # cancel: content events read before the client disconnects

    @property
    def route(self) -> str:
        return ROUTES[self.api]

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


@dataclass
class Outcome:
    """How one request ended: its OUTCOME, the HTTP status it got (None: no response) and,
    for what was not expected, why."""

    request: SoakRequest
    outcome: str
    status: int | None
    detail: str = ""
    seconds: float = 0.0

    @property
    def expected(self) -> bool:
        return self.outcome in EXPECTED[self.request.kind]


def parse_mix(text: str | None) -> dict[str, float]:
    """`kind=weight,...` over KINDS (kinds not named keep weight 0); None: KINDS' weights."""
    if not text:
        return dict(KINDS)
    mix = dict.fromkeys(KINDS, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, weight = part.partition("=")
        if kind not in KINDS or not weight:
            raise ValueError(f"--mix {part!r}: use KIND=WEIGHT with KIND from {', '.join(KINDS)}")
        mix[kind] = float(weight)
    if sum(mix.values()) <= 0:
        raise ValueError("--mix: give at least one kind a weight above 0")
    return mix


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(8, 24)))


def _body(api: str, text: str, max_tokens: int, stream: bool, ignore_eos: bool) -> dict:
    if api == "completion":
        body = {"prompt": text}
    else:
        body = {"messages": [{"role": "user", "content": text}]}
    body.update(max_tokens=max_tokens, temperature=0, stream=stream)
    if ignore_eos and api != "messages":     # Anthropic's schema has no ignore_eos
        body["ignore_eos"] = True
    if stream and api != "messages":
        body["stream_options"] = {"include_usage": True}
    return body


def draw_request(index: int, rng: random.Random, mix: dict[str, float], max_tokens: int,
                 cancel_tokens: int, marker: str | None) -> SoakRequest:
    """The index-th request of a run, from the run's seeded generator. Without a fault marker
    the mix has no faulty requests (their weight goes to nothing)."""
    kinds = [k for k, w in mix.items() if w > 0 and (k != "fault" or marker)]
    kind = rng.choices(kinds, weights=[mix[k] for k in kinds])[0]
    if kind in ("invalid", "cancel", "fault"):      # any protocol
        api = rng.choice(list(ROUTES))
    else:
        api = kind.removesuffix("_stream")
    text, tokens = _prompt(rng), rng.randint(1, max_tokens)
    if kind == "invalid":
        bad = rng.choice(INVALID[api])
        return SoakRequest(index, kind, api, {**_body(api, text, tokens, False, False), **bad})
    if kind == "cancel":
        body = _body(api, text, cancel_tokens, True, True)
        return SoakRequest(index, kind, api, body, leave_after=rng.choice((0, 1, 3)))
    if kind == "fault":
        body = _body(api, f"{text} {marker} {text}", tokens, rng.random() < 0.5, False)
        return SoakRequest(index, kind, api, body)
    return SoakRequest(index, kind, api, _body(api, text, tokens, kind.endswith("_stream"),
                                               False))


# ---- sending ----------------------------------------------------------------------------------

def _error_text(payload) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    return str(error.get("message") if isinstance(error, dict) else error or payload)[:300]


def classify_reply(request: SoakRequest, status: int, text: str) -> tuple[str, str]:
    """(outcome, detail) of a whole (not streamed) reply."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return "unexpected", f"HTTP {status} with a body that is not JSON: {text[:200]}"
    if status in (503, 529):
        return "refused", ""
    if status == 400 and "error" in payload:
        return "rejected", _error_text(payload)
    if status == 500 and FAULT_TEXT in _error_text(payload):
        return "failed", ""
    if status != 200:
        return "unexpected", f"HTTP {status}: {_error_text(payload)}"
    if request.api == "messages":
        ended = payload.get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence")
    else:
        ended = all(c.get("finish_reason") in ("stop", "length")
                    for c in payload.get("choices") or [{}])
    return ("completed", "") if ended else ("unexpected", f"no finish reason: {text[:200]}")


class StreamState:
    """Reads one SSE stream's events: content events seen, and how the stream ended."""

    def __init__(self, anthropic: bool):
        self.anthropic = anthropic
        self.events = 0            # content events
        self.finished = False      # a finish_reason (OpenAI) or message_stop (Anthropic)
        self.error = None          # the error event's message
        self.done = False          # OpenAI's [DONE]

    def feed(self, name: str | None, data: str) -> None:
        if data == "[DONE]":
            self.done = True
            return
        payload = json.loads(data)
        if "error" in payload and (not self.anthropic or name == "error"):
            self.error = _error_text(payload)
        elif self.anthropic:
            self.events += name == "content_block_delta"
            self.finished = self.finished or name == "message_stop"
        else:
            choices = payload.get("choices") or []
            self.events += any((c.get("delta") or {}).get("content") or c.get("text")
                               for c in choices)
            self.finished = self.finished or any(c.get("finish_reason") for c in choices)

    @property
    def over(self) -> bool:
        """The server has nothing more to send: OpenAI's [DONE] (after a finish or an error
        event), Anthropic's message_stop or error event."""
        if self.anthropic:
            return self.finished or self.error is not None
        return self.done

    def outcome(self) -> tuple[str, str]:
        if self.error is not None:
            if FAULT_TEXT not in self.error:
                return "unexpected", f"error event: {self.error}"
            if not self.over:
                return "unexpected", "an error event without [DONE] after it"
            return "failed", ""
        if self.over and self.finished:
            return "completed", ""
        return "unexpected", "the stream ended without a finish reason and [DONE]"


async def read_stream(request: SoakRequest, response) -> tuple[str, str]:
    """Read an accepted stream to its end, or (cancel) leave it after `leave_after` content
    events; the caller's `async with` then closes the connection."""
    state, name = StreamState(request.api == "messages"), None
    if request.kind == "cancel" and request.leave_after == 0:
        return "cancelled", ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            state.feed(name, line[len("data:"):].strip())
            name = None
            if state.over:
                break
            if request.kind == "cancel" and state.events >= request.leave_after:
                return "cancelled", ""
    return state.outcome()


async def send(client, base_url: str, request: SoakRequest) -> Outcome:
    """Send one request and classify how it ended; never raises for what the server or the
    network does (those are `unexpected` outcomes)."""
    import time

    import httpx

    start, status = time.perf_counter(), None
    try:
        async with client.stream("POST", base_url + request.route,
                                 json=request.body) as response:
            status = response.status_code
            if request.stream and status == 200:
                outcome, detail = await read_stream(request, response)
            else:
                text = (await response.aread()).decode(errors="replace")
                outcome, detail = classify_reply(request, status, text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome, detail = "unexpected", f"{type(exc).__name__}: {exc}"[:300]
    return Outcome(request, outcome, status, detail, time.perf_counter() - start)
