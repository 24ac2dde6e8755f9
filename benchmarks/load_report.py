"""The side-by-side table of a load run: one block per rate or concurrency, a column per server
and the ratio of the first server (FreeToken) to the second (llama-server)."""

from __future__ import annotations

# (label, path into a level's summary, scale, format); times print in milliseconds
ROWS = [
    ("requests/s", ("requests_per_s",), 1, "{:.2f}"),
    ("output tok/s", ("output_tok_per_s",), 1, "{:.1f}"),
    ("goodput req/s", ("goodput", "requests_per_s"), 1, "{:.2f}"),
    *[(f"{name} {q} ms", (key, q), 1e3, "{:.1f}")
      for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"))
      for q in ("p50", "p90", "p99")],
    ("latency p50 s", ("latency_s", "p50"), 1, "{:.2f}"),
    ("prompt tokens (mean)", ("mean_prompt_tokens",), 1, "{:.1f}"),
]


def _get(summary: dict, path: tuple[str, ...]):
    for key in path:
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def _errors(summary: dict) -> str:
    errors = summary["errors"]
    text = ", ".join(f"{kind} {n}" for kind, n in sorted(errors.items())) or "none"
    if summary["short_outputs"]:
        text += f"; {summary['short_outputs']} short"
    return text


def level_table(level: str, header: str, results: dict[str, dict], labels: dict[str, str]) -> str:
    """One level's block. `results` maps a server name to its record for the run ({"levels":
    {level: summary}} or {"unavailable": why}); `labels` gives each server's column title."""
    names = list(results)
    summaries = {n: results[n].get("levels", {}).get(level) for n in names}
    with_ratio = len(names) == 2 and all(summaries.values())
    titles = [labels[n] for n in names]
    columns = titles + ([f"{titles[0]}/{titles[1]}"] if with_ratio else [])
    width = max(14, *(len(t) for t in columns))
    lines = [header, f"{'':22}" + "".join(f"{t:>{width + 2}}" for t in columns)]
    done = [f"{s['completed']}/{s['requests']}" if s else "-" for s in summaries.values()]
    lines.append(f"{'completed':22}" + "".join(f"{c:>{width + 2}}" for c in done))
    for label, path, scale, fmt in ROWS:
        values = [_get(s, path) if s else None for s in summaries.values()]
        cells = [fmt.format(v * scale) if v is not None else "-" for v in values]
        if with_ratio:
            a, b = values
            cells.append(f"{a / b:.2f}x" if a is not None and b else "-")
        lines.append(f"{label:22}" + "".join(f"{c:>{width + 2}}" for c in cells))
    errors = [_errors(s) if s else results[n].get("unavailable", "not run")[:width]
              for n, s in summaries.items()]
    lines.append(f"{'errors':22}" + "".join(f"{c:>{width + 2}}" for c in errors))
    return "\n".join(lines)


def legend(ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> str:
    target = " and ".join(part for part in (
        f"TTFT <= {ttft_slo_ms:g} ms" if ttft_slo_ms is not None else "",
        f"TPOT <= {tpot_slo_ms:g} ms" if tpot_slo_ms is not None else "") if part) or "none"
    return (f"goodput: complete requests per second that met the target ({target}); "
            "TPOT: (last - first content chunk) / (output tokens - 1) per request; ITL: gaps "
            "between content chunks; the ratio is FreeToken / llama-server (above 1 is better for "
            "rates, below 1 for times)")
