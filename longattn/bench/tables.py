"""Formatting shared by the `run`/`scale` and `dist` tables: a throughput unit
that fits the numbers, figures with as many digits as they need, and rows
that could not run listed once below a table instead of as rows of dashes."""
from __future__ import annotations

from typing import Iterable, Optional


def flops_unit(tflops: Iterable[Optional[float]]) -> tuple[str, float]:
    """(unit, factor from TFLOP/s): TFLOP/s when the largest value reaches 1,
    else GFLOP/s (CPU runs), so the figures are not all 0.0."""
    vals = [v for v in tflops if v is not None]
    if vals and max(vals) >= 1.0:
        return "TFLOP/s", 1.0
    return "GFLOP/s", 1e3


def num(v: Optional[float]) -> str:
    """Three significant digits, no exponent in the usual ranges; "–" for none."""
    if v is None:
        return "–"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def not_run(rows: list[dict], status: str = "unsupported") -> list[str]:
    """One line per (implementation, reason) among ``rows`` with ``status``,
    naming the configs when the table holds more than one."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r.get("status") == status:
            groups.setdefault((r["impl"], r.get("reason") or "no reason recorded"), []).append(r["config"])
    if not groups:
        return []
    many = len({r["config"] for r in rows}) > 1
    lines = ["", f"Not run ({status}), implementation: reason:"]
    for (impl, reason), cfgs in groups.items():
        where = f" [{', '.join(dict.fromkeys(cfgs))}]" if many else ""
        lines.append(f"- {impl}{where}: {reason}")
    return lines


def impl_label(r: dict) -> str:
    """A `dist` row's implementation as a table shows it: torch-cp with how it
    ran (SDPA backend, rotate method), or "K/V repeated" for rows written
    before it ran with native GQA."""
    if r["impl"] != "torch-cp":
        return r["impl"]
    info = r.get("torch_cp")
    if not info:
        return "torch-cp (K/V repeated)" if "kv " in r.get("shape", "") else "torch-cp"
    return f"torch-cp ({info.get('sdpa_backend')}, {info.get('rotate_method')})"

