"""`shardtrain plan --layout` text: `dp=32,tp=8,pp=4,zero=1,...` into a Layout, each key
and value checked with a message naming it."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from shardtrain.plan.layout import Layout, PlanError

_KEYS = {f.name: f.type for f in dataclasses.fields(Layout)} | {"mb": "int"}
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_layout(text: str, *, gpus: int, global_batch: int, precision: str,
                 attention: str = "flash") -> Layout:
    """`dp=32,tp=8,pp=4,zero=1,...`: dp may be left out (it fills the GPUs); give one of
    microbatches / micro_batch (alias mb) and the other follows from the global batch
    (neither: micro_batch = 1); `attention` unless the text names one (the planned
    kernel: layout.planned_attention)."""
    values: dict[str, Any] = {"precision": precision, "attention": attention}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep:
            raise PlanError(f"--layout item {item!r} is not KEY=VALUE")
        if key not in _KEYS:
            close = difflib.get_close_matches(key, list(_KEYS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PlanError(f"--layout: unknown key {key!r}{hint} (valid: {', '.join(_KEYS)})")
        values["micro_batch" if key == "mb" else key] = _value(key, raw, _KEYS[key])
    tp, pp, cp = (values.get(k, 1) for k in ("tp", "pp", "cp"))
    values.setdefault("dp", max(1, (gpus - values.get("ps_servers", 0)) // (tp * pp * cp)))
    if "microbatches" not in values:
        per_call = values["dp"] * values.get("micro_batch", 1)
        values["microbatches"] = max(1, global_batch // per_call)
    elif "micro_batch" not in values:
        values["micro_batch"] = max(1, global_batch // (values["dp"] * values["microbatches"]))
    return Layout(**values)


def _value(key: str, raw: str, kind: str) -> Any:
    if kind == "bool":
        if raw.lower() not in _BOOL:
            raise PlanError(f"--layout {key}={raw!r} is not a boolean (true or false)")
        return _BOOL[raw.lower()]
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise PlanError(f"--layout {key}={raw!r} must be a whole number") from None
    return raw
