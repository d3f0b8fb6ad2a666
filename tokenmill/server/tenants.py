"""Tenants: who a request belongs to, found from its API key.

`tokenmill serve --tenants FILE` reads a JSON or YAML file of this shape (README,
"Tenants"); every field but `name` and `api_keys` is optional, a missing limit is no
limit:

    {"tenants": [
      {"name": "acme", "api_keys": ["sk-acme-1", "sha256:<hex>"], "priority": 0, "weight": 2,
       "requests_per_minute": 600, "tokens_per_minute": 200000, "max_concurrent_requests": 64,
       "token_quota": 5000000, "quota_period": "month", "models": ["*"]}]}

Keys are held only as their sha256 digests, so a file may give `sha256:<hex>` and
hold no secret; a key is looked up by its digest (a dict lookup on a digest of
the secret leaks nothing an attacker can use to guess it). `--api-key KEY` alone is one tenant,
`default`, with no limits. A bad file stops the server with an error that names the
file, the tenant and the field.
"""

from __future__ import annotations

import calendar
import datetime as dt
import fnmatch
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUOTA_PERIODS = ("day", "week", "month", "total")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "token_quota")
_FIELDS = {"name", "api_keys", "priority", "weight", *_LIMITS, "quota_period", "models"}


class TenantsFileError(ValueError):
    """A tenants file that cannot be served: names the file, the tenant and the field."""

    def __init__(self, path: str, message: str, tenant: str | None = None, field: str | None = None) -> None:
        where = path + (f": tenant {tenant!r}" if tenant is not None else "") + (f": {field}" if field else "")
        super().__init__(f"{where}: {message}")
        self.path, self.tenant, self.field = path, tenant, field


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key_digests: tuple[str, ...]  # sha256 hex of each key
    priority: int = 0  # the best lane its requests may ask for (lower runs first, as vLLM's)
    weight: float = 1.0  # its share under scheduling_policy="fair"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + max_tokens reserved at admission
    max_concurrent_requests: int | None = None
    token_quota: int | None = None  # prompt + completion tokens per quota_period
    quota_period: str = "month"
    models: tuple[str, ...] = ("*",)

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def period(self, now: float) -> tuple[str, float, float]:
        """The quota period holding `now`: (key, start, end) in seconds since the epoch, UTC
        calendar days, weeks from Monday, months; `total` never ends."""
        if self.quota_period == "total":
            return "total", 0.0, math.inf
        day = dt.datetime.fromtimestamp(now, dt.timezone.utc).date()
        if self.quota_period == "day":
            start, end = day, day + dt.timedelta(days=1)
        elif self.quota_period == "week":
            start = day - dt.timedelta(days=day.weekday())
            end = start + dt.timedelta(days=7)
        else:
            start = day.replace(day=1)
            end = start + dt.timedelta(days=calendar.monthrange(start.year, start.month)[1])
        return start.isoformat(), _epoch(start), _epoch(end)


def _epoch(day: dt.date) -> float:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc).timestamp()


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tenants:
    """The tenants of one server and their keys."""

    def __init__(self, tenants: Sequence[Tenant], source: str = "<tenants>") -> None:
        self.tenants = list(tenants)
        self.by_name = {t.name: t for t in self.tenants}
        self._by_digest: dict[str, Tenant] = {}
        for t in self.tenants:
            for digest in t.key_digests:
                other = self._by_digest.setdefault(digest, t)
                if other is not t or t.key_digests.count(digest) > 1:
                    raise TenantsFileError(source, f"an API key is given twice (also for tenant {other.name!r})",
                                           t.name, "api_keys")

    def __len__(self) -> int:
        return len(self.tenants)

    def authenticate(self, key: str) -> Tenant | None:
        return self._by_digest.get(key_digest(key))

    @classmethod
    def single_key(cls, api_key: str) -> Tenants:
        """`--api-key KEY`: one tenant, `default`, with no limits."""
        return cls([Tenant("default", (key_digest(api_key),))], "--api-key")


def load_tenants(path: str | Path) -> Tenants:
    """Reads and checks a tenants file (JSON, or YAML by its .yaml/.yml suffix); raises
    TenantsFileError."""
    return parse_tenants(read_tenants_file(path), str(path))


def read_tenants_file(path: str | Path) -> Any:
    """The file's data as it is (the benchmark reads the plain keys from it)."""
    source = str(path)
    is_yaml = Path(path).suffix.lower() in (".yaml", ".yml")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TenantsFileError(source, f"cannot be read: {e.strerror or e}") from e
    try:
        if is_yaml:
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as e:  # noqa: BLE001 - json and yaml raise their own types
        # where, not what: the parsers quote the offending line, which may hold a key
        mark = getattr(e, "problem_mark", None)
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (getattr(e, "lineno", "?"),
                                                                                  getattr(e, "colno", "?"))
        raise TenantsFileError(source, f"is not valid {'YAML' if is_yaml else 'JSON'} (line {line}, column "
                               f"{column})") from None


def parse_tenants(data: Any, source: str = "<tenants>") -> Tenants:
    if not isinstance(data, dict) or set(data) != {"tenants"}:
        raise TenantsFileError(source, 'must be an object with one key, "tenants" (a list of tenants)')
    entries = data["tenants"]
    if not isinstance(entries, list) or not entries:
        raise TenantsFileError(source, "must be a non-empty list", field="tenants")
    tenants = [_tenant(entry, i, source) for i, entry in enumerate(entries)]
    seen: set[str] = set()
    for t in tenants:
        if t.name in seen:
            raise TenantsFileError(source, "the name is given to two tenants", t.name, "name")
        seen.add(t.name)
    return Tenants(tenants, source)


def _tenant(entry: Any, index: int, source: str) -> Tenant:
    if not isinstance(entry, dict):
        raise TenantsFileError(source, f"tenants[{index}] must be an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise TenantsFileError(source, f"tenants[{index}] needs a non-empty string", field="name")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise TenantsFileError(source, f"unknown field (allowed: {', '.join(sorted(_FIELDS))})", name, unknown[0])

    def fail(field: str, message: str) -> TenantsFileError:
        return TenantsFileError(source, message, name, field)

    keys = entry.get("api_keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise fail("api_keys", "must be a non-empty list of non-empty strings")
    limits: dict[str, int | None] = {}
    for field in _LIMITS:
        value = entry.get(field)
        if value is not None and (not _is_int(value) or value < 0):
            raise fail(field, f"must be an integer >= 0 (or left out: no limit), got {value!r}")
        limits[field] = value
    priority = entry.get("priority", 0)
    if not _is_int(priority):
        raise fail("priority", f"must be an integer, got {priority!r}")
    weight = entry.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise fail("weight", f"must be a number > 0, got {weight!r}")
    period = entry.get("quota_period", "month")
    if period not in QUOTA_PERIODS:
        raise fail("quota_period", f"must be one of {', '.join(QUOTA_PERIODS)}, got {period!r}")
    models = entry.get("models", ["*"])
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise fail("models", 'must be a non-empty list of model names or patterns ("*": every model)')
    return Tenant(name, tuple(_digests(keys, fail)), priority, float(weight), quota_period=period,
                  models=tuple(models), **limits)


def _digests(keys: Iterable[str], fail: Any) -> list[str]:
    out = []
    for key in keys:
        if key.startswith("sha256:"):
            digest = key.removeprefix("sha256:").lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise fail("api_keys", "a sha256: key must be followed by 64 hex digits")
            out.append(digest)
        else:
            out.append(key_digest(key))
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
