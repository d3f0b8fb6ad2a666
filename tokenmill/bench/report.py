"""Reports of a benchmark run: a rich console table and JSON."""

from __future__ import annotations

import json
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
    Path(path).write_text(json.dumps(data, indent=2))
