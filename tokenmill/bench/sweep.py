"""`tokenmill bench sweep` (one run per load level: the throughput-latency curve as PNG,
CSV and JSON) and `tokenmill bench sla` (the highest throughput whose run meets an SLO
on its statistics, found by doubling the load and then bisecting)."""

from __future__ import annotations

import argparse
import csv
import logging
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.metrics import RUN_SLO_KEYS, parse_slo
from tokenmill.bench.report import write_json
from tokenmill.bench.serve import build_workload, config_json, describe, prepare, print_result, run_once

CSV_COLUMNS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
               "max_output_tokens_per_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
               "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
               "median_e2el_ms", "p99_e2el_ms", "mean_user_decode_tokens_per_s", "request_goodput",
               "dollars_per_million_output_tokens")


def parse_levels(text: str, flag: str, integer: bool) -> list[float]:
    """'1,2,4' -> [1, 2, 4]; rates may be 'inf'. ValueError naming the flag."""
    levels = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = int(part) if integer else float(part)
        except ValueError:
            kind = "integers" if integer else "numbers (or inf)"
            raise ValueError(f"{flag}: expected comma-separated {kind}, got {part!r}") from None
        if not value > 0:
            raise ValueError(f"{flag}: every level must be > 0, got {part!r}")
        levels.append(value)
    if not levels:
        raise ValueError(f"{flag}: no level given")
    return levels


def _level_args(args: argparse.Namespace, by: str, level: float) -> dict[str, Any]:
    if by == "concurrency":
        return {"request_rate": math.inf, "max_concurrency": int(level)}
    return {"request_rate": level, "max_concurrency": args.max_concurrency}


def _label(by: str, level: float) -> str:
    return f"c={int(level)}" if by == "concurrency" else f"{level:g}/s"


def bench_sweep(args: argparse.Namespace) -> int:
    if (args.concurrency is None) == (args.request_rates is None):
        raise ValueError("give exactly one of --concurrency LIST or --request-rates LIST")
    by = "concurrency" if args.concurrency is not None else "request_rate"
    if by == "concurrency":
        levels = parse_levels(args.concurrency, "--concurrency", integer=True)
    else:
        levels = parse_levels(args.request_rates, "--request-rates", integer=False)
    slo = parse_slo(args.slo) if args.slo else None
    requests, workload, tokenizer = prepare(args)
    points = []
    for level in levels:
        result, _ = run_once(args, requests, tokenizer, slo=slo, desc=_label(by, level), **_level_args(args, by, level))
        points.append({by: level, **result})
        print(f"{_label(by, level)}: {result['output_throughput']:,.1f} output tok/s, median TTFT "
              f"{result['median_ttft_ms']:,.1f} ms, median TPOT {result['median_tpot_ms']:,.2f} ms, "
              f"{result['failed']} failed", flush=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"by": by, "workload": workload, "config": config_json(args), "points": points}
    write_json(out / "sweep.json", data)
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([by, *CSV_COLUMNS])
        for p in points:
            writer.writerow([p[by], *(p.get(c, "") for c in CSV_COLUMNS)])
    plot_sweep(points, by, out / "sweep.png", title=f"{args.model} ({args.endpoint}) at {args.base_url}")
    print_points(f"tokenmill bench sweep: {args.base_url} ({args.model}, {args.endpoint})", points, by)
    print(f"workload: {workload}")
    print(f"wrote {out / 'sweep.png'}, {out / 'sweep.csv'}, {out / 'sweep.json'}")
    return 0 if all(p["completed"] for p in points) else 1


# the points table: short headers, so that it fits a terminal
POINT_COLUMNS = {"output_throughput": "out tok/s", "request_throughput": "req/s", "median_ttft_ms": "TTFT p50",
                 "p99_ttft_ms": "TTFT p99", "median_tpot_ms": "TPOT p50", "p99_tpot_ms": "TPOT p99", "failed": "failed"}


def print_points(title: str, points: list[dict[str, Any]], by: str, slo: dict[str, float] | None = None) -> None:
    columns = {**POINT_COLUMNS, **{k: k for k in slo or () if k not in POINT_COLUMNS}}
    table = Table(title=title)
    table.add_column("level")
    for header in columns.values():
        table.add_column(header, justify="right")
    if slo:
        table.add_column("SLO")
    for p in points:
        cells = (f"{p[c]:,.1f}" if isinstance(p[c], float) else f"{p[c]:,}" for c in columns)
        table.add_row(_label(by, p[by]), *cells, *(["met" if p["meets_slo"] else "missed"] if slo else []))
    Console().print(table)


def plot_sweep(points: list[dict[str, Any]], by: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    x = [p["output_throughput"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, name in ((axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [p[f"{stat}_{metric}_ms"] for p in points], style, label=f"{stat}")
        for p, xi in zip(points, x):
            ax.annotate(_label(by, p[by]), (xi, p[f"median_{metric}_ms"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_sla(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo, RUN_SLO_KEYS)
    by = "concurrency" if args.search == "concurrency" else "request_rate"
    integer = by == "concurrency"
    lower, upper = args.lower, args.upper
    if not 0 < lower <= upper or (integer and (lower != int(lower) or upper != int(upper))):
        raise ValueError(f"--lower and --upper must satisfy 0 < lower <= upper{' (integers)' if integer else ''}, "
                         f"got {lower:g} and {upper:g}")
    if not 0 < args.rate_tolerance < 1:
        raise ValueError(f"--rate-tolerance must be in (0, 1), got {args.rate_tolerance}")
    prepared, workload, tokenizer = prepare(args)
    probes: list[dict[str, Any]] = []

    def probe(level: float) -> bool:
        # a concurrency probe sends at least 4 requests per slot, so that the level is held
        num = max(args.num_prompts, 4 * int(level)) if integer else args.num_prompts
        requests = prepared
        if num != args.num_prompts:
            requests, _ = build_workload(argparse.Namespace(**{**vars(args), "num_prompts": num}), tokenizer)
        result, _ = run_once(args, requests, tokenizer, desc=_label(by, level), **_level_args(args, by, level))
        ok = result["failed"] == 0 and all(result[k] <= limit for k, limit in slo.items())
        probes.append({by: level, "meets_slo": ok, **result})
        shown = ", ".join(f"{k} {result[k]:,.1f}" for k in slo)
        print(f"{_label(by, level)}: {result['output_throughput']:,.1f} output tok/s, {shown}, "
              f"{result['failed']} failed: {'meets' if ok else 'misses'} the SLO", flush=True)
        return ok

    good, bad = None, None
    level = int(lower) if integer else lower
    while True:  # double until the SLO is missed or the upper bound is reached
        if not probe(level):
            bad = level
            break
        good = level
        if level >= upper:
            break
        level = min(upper, level * 2)
        level = int(level) if integer else level
    while good is not None and bad is not None and (bad - good > 1 if integer else bad / good - 1 > args.rate_tolerance):
        mid = (good + bad) // 2 if integer else math.sqrt(good * bad)
        if probe(mid):
            good = mid
        else:
            bad = mid
    passing = [p for p in probes if p["meets_slo"]]
    best = max(passing, key=lambda p: p["output_throughput"]) if passing else None
    print_points(f"tokenmill bench sla: {args.base_url} ({args.model}, {args.endpoint}), SLO {args.slo}",
                 sorted(probes, key=lambda p: p[by]), by, slo)
    if best is None:
        print(f"no load level meets the SLO, not even {_label(by, lower)}")
    else:
        print_result(f"best run that meets the SLO: {describe(args, **_level_args(args, by, best[by]))}", best,
                     workload)
        if bad is None:
            print(f"--upper {upper:g} was reached with the SLO still met: the server may do more")
    if args.output_json:
        write_json(args.output_json, {"slo": slo, "by": by, "best": best, "probes": probes, "workload": workload,
                                      "config": config_json(args)})
    return 0 if best is not None else 1
