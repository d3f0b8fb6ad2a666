"""Serving metrics from per-request, per-chunk timestamps, defined as `vllm bench serve`
defines them so that figures compare:

    TTFT  first chunk that carries text - request sent
    TPOT  (E2E - TTFT) / (output tokens - 1), per request with more than one token
    ITL   every gap between consecutive text-bearing chunks of a request
    E2E   last byte - request sent

Failed requests are counted, never mixed into the latency figures.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.bench.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
# per-request objectives (goodput) and objectives on a run's statistics (bench sla)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
GOODPUT_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}  # vLLM's --goodput names
RUN_SLO_KEYS = tuple(f"{stat}_{metric}_ms" for metric in METRICS
                     for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)))


def parse_slo(text: str, keys: Sequence[str] = SLO_KEYS) -> dict[str, float]:
    """'ttft_ms=200,tpot_ms=50' -> {'ttft_ms': 200.0, 'tpot_ms': 50.0}; ValueError naming the problem."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise ValueError(f"--slo: expected KEY=MILLISECONDS with KEY in {', '.join(keys)}, got {part!r}")
        slo[key] = _milliseconds("--slo", key, value)
    if not slo:
        raise ValueError(f"--slo: no objective given; expected KEY=MILLISECONDS,... with KEY in {', '.join(keys)}")
    return slo


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """vLLM's --goodput: ['ttft:200', 'tpot:50'] -> {'ttft_ms': 200.0, 'tpot_ms': 50.0} (as --slo)."""
    slo: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: expected KEY:MILLISECONDS with KEY in {', '.join(GOODPUT_KEYS)}, "
                             f"got {pair!r}")
        slo[GOODPUT_KEYS[key]] = _milliseconds("--goodput", key, value)
    return slo


def _milliseconds(flag: str, key: str, value: str) -> float:
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"{flag}: {key} must be a number of milliseconds, got {value!r}") from None
    if not ms > 0:
        raise ValueError(f"{flag}: {key} must be > 0, got {value!r}")
    return ms


def parse_percentile_metrics(text: str | None) -> tuple[str, ...]:
    """vLLM's --percentile-metrics: 'ttft,e2el' -> ('ttft', 'e2el'); None: all of METRICS."""
    if text is None:
        return METRICS
    names = tuple(p.strip() for p in text.split(","))
    if not all(name in METRICS for name in names):
        raise ValueError(f"--percentile-metrics: expected a comma-separated list of {', '.join(METRICS)}, "
                         f"got {text!r}")
    return names


def parse_percentiles(text: str | None) -> tuple[float, ...]:
    """vLLM's --metric-percentiles: '50,99.9' -> (50.0, 99.9); None: PERCENTILES."""
    if text is None:
        return PERCENTILES
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles: expected comma-separated numbers, got {text!r}") from None
    if not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles: every percentile must be in [0, 100], got {text!r}")
    return values


def percentile_key(p: float, metric: str) -> str:
    """vLLM's key: p99_ttft_ms, p99.9_ttft_ms."""
    return f"p{int(p) if p == int(p) else p}_{metric}_ms"


def request_latencies(r: RequestRecord) -> dict[str, float | None]:
    """ttft_ms, tpot_ms (None with one token), e2e_ms of one successful request."""
    ttft = r.ttft
    e2e = r.end - r.start
    tpot = None
    if ttft is not None and r.output_tokens and r.output_tokens > 1:
        tpot = (e2e - ttft) / (r.output_tokens - 1)
    return {"ttft_ms": None if ttft is None else 1000 * ttft, "tpot_ms": None if tpot is None else 1000 * tpot,
            "e2e_ms": 1000 * e2e}


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    lat = request_latencies(r)
    if lat["tpot_ms"] is None:
        lat["tpot_ms"] = 0.0  # one output token: no time per output token, as vLLM counts goodput
    return all(lat[key] is not None and lat[key] <= limit for key, limit in slo.items())  # type: ignore[operator]


def cost_figures(output_throughput: float, cost_per_hour: float, num_gpus: int = 1) -> dict[str, float]:
    """`cost_per_hour` is the price of one GPU (or machine) hour; `num_gpus` of them serve.
    10,000 output tokens/s at $10/h: 36M tokens per hour, $0.2778 per million."""
    dollars_per_hour = cost_per_hour * num_gpus
    tokens_per_hour = output_throughput * 3600.0
    return {
        "cost_per_hour": dollars_per_hour,
        "output_tokens_per_dollar": tokens_per_hour / dollars_per_hour if dollars_per_hour else float("inf"),
        "dollars_per_million_output_tokens": (dollars_per_hour / tokens_per_hour * 1e6 if tokens_per_hour
                                              else float("inf")),
        "output_throughput_per_gpu": output_throughput / num_gpus,
    }


def summarize(records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None = None,
              cost_per_hour: float | None = None, num_gpus: int = 1, metrics: Sequence[str] = METRICS,
              percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | int]:
    """The report of one run, with vLLM's key names (`mean_ttft_ms`, `p99_itl_ms`, ...): mean,
    median, std and `percentiles` of each of `metrics`."""
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    out: dict[str, float | int] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    lats = [request_latencies(r) for r in ok]
    series = {
        "ttft": [x["ttft_ms"] for x in lats if x["ttft_ms"] is not None],
        "tpot": [x["tpot_ms"] for x in lats if x["tpot_ms"] is not None],
        "itl": [1000 * (b - a) for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])],
        "e2el": [x["e2e_ms"] for x in lats],
    }
    for name in metrics:
        arr = np.asarray(series[name], dtype=np.float64)
        out[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else 0.0
        out[f"median_{name}_ms"] = float(np.median(arr)) if arr.size else 0.0
        out[f"std_{name}_ms"] = float(arr.std()) if arr.size else 0.0
        for p in percentiles:
            out[percentile_key(p, name)] = float(np.percentile(arr, p)) if arr.size else 0.0
    out["max_output_tokens_per_s"] = peak_output_throughput(ok)
    # how late requests left against the arrival schedule (with --max-concurrency this includes
    # the wait for a free slot, by design)
    late = [1000 * (r.start - r.scheduled) for r in records if r.scheduled is not None]
    out["mean_send_lateness_ms"] = float(np.mean(late)) if late else 0.0
    out["max_send_lateness_ms"] = float(np.max(late)) if late else 0.0
    speeds = [1000.0 / x["tpot_ms"] for x in lats if x["tpot_ms"]]
    out["mean_user_decode_tokens_per_s"] = float(np.mean(speeds)) if speeds else 0.0
    if slo is not None:
        out["request_goodput"] = sum(meets_slo(r, slo) for r in ok) / duration
    if cost_per_hour is not None:
        out.update(cost_figures(out["output_throughput"], cost_per_hour, num_gpus))  # type: ignore[arg-type]
    return out


def peak_output_throughput(records: Sequence[RequestRecord], window: float = 1.0) -> float:
    """Most output tokens delivered in one `window`-second bin. A chunk's tokens are its
    request's tokens spread evenly over its chunks (chunks may carry several tokens)."""
    times, weights = [], []
    for r in records:
        if r.chunk_times and r.output_tokens:
            times += r.chunk_times
            weights += [r.output_tokens / len(r.chunk_times)] * len(r.chunk_times)
    if not times:
        return 0.0
    t = np.asarray(times)
    bins = np.floor((t - t.min()) / window).astype(np.int64)
    return float(np.bincount(bins, weights=np.asarray(weights)).max() / window)
