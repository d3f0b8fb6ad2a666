"""Multi-tenant load: which tenant sends each request, and what each tenant got.

`bench serve --tenants FILE --tenant-mix acme=0.7,batch-jobs=0.3` reads the server's own
tenants file (server/tenants.py) for one plain API key and the weight of each tenant,
gives each request a tenant in exact proportion to the mix (shuffled with --seed), sends
it with that tenant's key, and reports each tenant's figures and Jain's fairness index
over weighted service. A script that drives tenants on arrival processes of their own
builds one request list and schedule per tenant and merges them:

    mix = load_tenant_mix("tenants.yaml", "acme=1,batch-jobs=1")  # keys and weights
    a = with_tenant(text_requests(...), "acme"); b = with_tenant(text_requests(...), "batch-jobs")
    requests, offsets = interleave([(a, arrival_offsets(len(a), 8.0)), (b, [0.0] * len(b))])
    records, duration = asyncio.run(run_benchmark(url, model, requests, offsets=offsets, tenant_keys=mix.keys))
    report = tenant_report(records, duration, mix.weights)
    j = fairness_index(report)
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.client import RequestRecord
from tokenmill.bench.metrics import summarize
from tokenmill.bench.workloads import BenchRequest

# per-tenant latency figures: mean, median and p99 of each (metrics.py's definitions and key names)
TENANT_METRICS = ("ttft", "tpot", "e2el")
TENANT_STATS = tuple(f"{stat}_{m}_ms" for m in TENANT_METRICS for stat in ("mean", "median", "p99"))


@dataclass(frozen=True, slots=True)
class BenchTenant:
    """A tenant as the benchmark sends: its first plain key (None when the file holds only
    `sha256:` digests of its keys, which cannot be sent) and its weight."""

    name: str
    key: str | None
    weight: float = 1.0


def read_bench_tenants(path: str | Path, flag: str = "--tenants") -> dict[str, BenchTenant]:
    """The tenants of a server's tenants file, checked as the server checks it, in file
    order. ValueError naming `flag`, the file and the tenant."""
    from tokenmill.server.tenants import parse_tenants, read_tenants_file

    try:
        data = read_tenants_file(path)
        checked = parse_tenants(data, str(path))
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from e
    out = {}
    for entry, tenant in zip(data["tenants"], checked.tenants):
        key = next((k for k in entry["api_keys"] if not k.startswith("sha256:")), None)
        out[tenant.name] = BenchTenant(tenant.name, key, tenant.weight)
    return out


def tenant_keys(tenants: Mapping[str, BenchTenant], names: Iterable[str], flag: str = "--tenants") -> dict[str, str]:
    """name -> the key to send as, for each of `names`; ValueError for a tenant without a plain key."""
    keys = {}
    for name in names:
        key = tenants[name].key
        if key is None:
            raise ValueError(f"{flag}: tenant {name!r} has only sha256: keys; the benchmark needs a plain key to "
                             f"send as (add one to its api_keys, or leave it out of --tenant-mix)")
        keys[name] = key
    return keys


@dataclass(frozen=True, slots=True)
class TenantMix:
    """Who sends: each tenant's share of the requests (normalised), key and weight."""

    shares: dict[str, float]
    keys: dict[str, str]
    weights: dict[str, float]

    def __post_init__(self) -> None:
        if not self.shares or set(self.shares) != set(self.keys) or set(self.shares) != set(self.weights):
            raise ValueError(f"shares, keys and weights must name the same tenants (at least one), got "
                             f"{sorted(self.shares)}, {sorted(self.keys)} and {sorted(self.weights)}")
        if not all(s > 0 for s in self.shares.values()) or not all(w > 0 for w in self.weights.values()):
            raise ValueError(f"shares and weights must be > 0, got {self.shares} and {self.weights}")

    def describe(self) -> str:
        return ", ".join(f"{name} {share:.0%} (weight {self.weights[name]:g})" for name, share in self.shares.items())


def load_tenant_mix(path: str | Path, mix: str | None = None) -> TenantMix:
    """--tenants FILE and --tenant-mix NAME=SHARE,...: the tenants of the mix (default: all,
    equal shares) with their keys and weights. ValueError naming the flag."""
    tenants = read_bench_tenants(path)
    shares = parse_tenant_mix(mix, tenants)
    return TenantMix(shares, tenant_keys(tenants, shares), {name: tenants[name].weight for name in shares})


def parse_tenant_mix(text: str | None, tenants: Mapping[str, BenchTenant],
                     flag: str = "--tenant-mix") -> dict[str, float]:
    """'acme=0.7,batch-jobs=0.3' -> {'acme': 0.7, 'batch-jobs': 0.3}, shares normalised to sum
    to 1; None: every tenant, equal shares. ValueError naming `flag`."""
    if text is None:
        return {name: 1.0 / len(tenants) for name in tenants}
    shares: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name:
            raise ValueError(f"{flag}: expected NAME=SHARE,... (e.g. acme=0.7,batch-jobs=0.3), got {part!r}")
        if name not in tenants:
            raise ValueError(f"{flag}: {name!r} is not a tenant of --tenants (its tenants: {', '.join(tenants)})")
        if name in shares:
            raise ValueError(f"{flag}: tenant {name!r} is given twice")
        try:
            share = float(value)
        except ValueError:
            raise ValueError(f"{flag}: the share of {name!r} must be a number, got {value!r}") from None
        if not 0 < share < math.inf:
            raise ValueError(f"{flag}: the share of {name!r} must be > 0, got {value!r}")
        shares[name] = share
    total = sum(shares.values())
    return {name: share / total for name, share in shares.items()}


def assign_tenants(num: int, shares: Mapping[str, float], seed: int = 0) -> list[str]:
    """A tenant per request: each tenant's count is its share of `num`, rounded by largest
    remainder (exact, so that a run's split is the mix and not a sample of it), in an
    order shuffled with `seed`."""
    total = sum(shares.values())
    quotas = {name: num * share / total for name, share in shares.items()}
    counts = {name: math.floor(q) for name, q in quotas.items()}
    by_remainder = sorted(quotas, key=lambda name: quotas[name] - counts[name], reverse=True)  # stable: mix order
    for name in by_remainder[:num - sum(counts.values())]:
        counts[name] += 1
    names = [name for name, count in counts.items() for _ in range(count)]
    random.Random(f"tenants-{seed}").shuffle(names)  # a seed of its own: no tie to the workload's draws
    return names


def with_tenant(requests: Iterable[BenchRequest], tenant: str | Sequence[str]) -> list[BenchRequest]:
    """The requests, sent as `tenant` (one name for all, or one name per request)."""
    requests = list(requests)
    names = [tenant] * len(requests) if isinstance(tenant, str) else list(tenant)
    if len(names) != len(requests):
        raise ValueError(f"one tenant per request, got {len(names)} for {len(requests)} requests")
    return [dataclasses.replace(r, tenant=name) for r, name in zip(requests, names)]


def interleave(streams: Iterable[tuple[Sequence[BenchRequest], Sequence[float]]]) -> tuple[list[BenchRequest],
                                                                                          list[float]]:
    """Merges (requests, send offsets) streams, one per tenant and arrival process, into one
    list and schedule in time order (for run_benchmark's `offsets`)."""
    merged = sorted(((at, i, j, r) for i, (requests, offsets) in enumerate(streams)
                     for j, (r, at) in enumerate(zip(requests, offsets, strict=True))), key=lambda x: x[:3])
    return [r for *_, r in merged], [at for at, *_ in merged]


def jain_index(service: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Jain's fairness index over weighted service, J = (sum x)^2 / (n * sum x^2) with
    x_i = service_i / weight_i.

    Weighted fair sharing (VTC, the scheduler's `fair` policy) aims at equal service per
    unit of weight, so J measures the distance from that aim on a scale that does not
    depend on the number of tenants or the units: equal weighted service gives 1, one
    tenant taking everything gives 1/n, and k of n tenants sharing equally gives k/n.
    J compares what tenants got, not what they asked for: it reads as fairness only when
    every tenant asks for more than its weighted share (all backlogged); a 0.7/0.3 mix on
    an idle server scores below 1 by the mix alone. NaN when nobody got anything."""
    weights = [1.0] * len(service) if weights is None else list(weights)
    if len(weights) != len(service) or not service:
        raise ValueError(f"one weight per tenant and at least one tenant, got {len(service)} and {len(weights)}")
    x = [s / w for s, w in zip(service, weights)]
    squares = sum(v * v for v in x)
    return sum(x) ** 2 / (len(x) * squares) if squares > 0 else math.nan


def tenant_report(records: Sequence[RequestRecord], duration: float, weights: Mapping[str, float],
                  shares: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Each tenant's figures from the run's records: requests sent, completed and failed (by
    HTTP status: "429", "500", ...; "stream" for an error event after a 200, "connection" for
    no answer; 429s also as `rate_limited`),
    tokens, output throughput over the whole run's `duration`, latencies (TENANT_STATS),
    and service = prompt + output tokens of its completed requests, also per unit of weight.
    Tenants are those of `weights` (a tenant that sent nothing has zeros)."""
    by_tenant: dict[str, list[RequestRecord]] = {name: [] for name in weights}
    for r in records:
        if r.tenant not in by_tenant:
            raise ValueError(f"a record of tenant {r.tenant!r}, which `weights` does not name")
        by_tenant[r.tenant].append(r)
    report = {}
    for name, mine in by_tenant.items():
        s = summarize(mine, duration, metrics=TENANT_METRICS, percentiles=(99,))
        statuses = Counter(_failure_kind(r) for r in mine if not r.ok)
        service = s["total_input_tokens"] + s["total_output_tokens"]
        report[name] = {
            "weight": weights[name], **({"share": shares.get(name, 0.0)} if shares is not None else {}),
            "requests": len(mine), "completed": s["completed"], "failed": s["failed"],
            "rate_limited": statuses["429"], "failed_by_status": dict(sorted(statuses.items())),
            "input_tokens": s["total_input_tokens"], "output_tokens": s["total_output_tokens"],
            "output_throughput": s["output_throughput"], "service": service,
            "weighted_service": service / weights[name], **{k: s[k] for k in TENANT_STATS},
        }
    total = sum(t["service"] for t in report.values())
    for t in report.values():
        t["service_share"] = t["service"] / total if total else 0.0
    return report


def _failure_kind(r: RequestRecord) -> str:
    if r.status is None:
        return "connection"
    return "stream" if r.status == 200 else str(r.status)


def fairness_index(report: Mapping[str, Mapping[str, Any]]) -> float:
    """Jain's index over the weighted service of every tenant in a tenant_report."""
    return jain_index([t["service"] for t in report.values()], [t["weight"] for t in report.values()])


def print_tenant_table(report: Mapping[str, Mapping[str, Any]], fairness: float) -> None:
    """One column per tenant, one row per figure."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"per tenant (Jain's index {fairness:.4f})")
    table.add_column("metric")
    for name in report:
        table.add_column(name, justify="right")
    for key in next(iter(report.values())):
        cells = [report[name][key] for name in report]
        if key == "failed_by_status":
            cells = [", ".join(f"{status}: {n}" for status, n in c.items()) or "-" for c in cells]
        else:
            cells = [f"{c:,.2f}" if isinstance(c, float) else f"{c:,}" for c in cells]
        table.add_row(key, *cells)
    Console().print(table)
