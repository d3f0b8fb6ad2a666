"""Reports of a benchmark run: a rich console table and JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.client import RequestRecord


def print_table(title: str, result: dict[str, Any]) -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if isinstance(value, (int, float)):
            table.add_row(key, f"{value:,.2f}" if isinstance(value, float) else f"{value:,}")
    Console().print(table)


def write_json(path: str | Path, result: dict[str, Any], records: list[RequestRecord] | None = None) -> None:
    data = dict(result)
    if records is not None:
        data["requests"] = [asdict(r) for r in records]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(data), indent=2, allow_nan=False))


def _finite(obj: Any) -> Any:
    """JSON has no infinity or NaN: they are written as the strings "inf" and "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
