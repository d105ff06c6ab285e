"""Learning curves as inline SVG, drawn from ``metrics.jsonl`` (no plotting library, no script).

One small chart per metric: the line over steps, the first and last step on the x axis, the
lowest and highest value on the y axis, and every point's value in its tooltip. A step that logged
no value for the metric (or a non-finite one, written as null) breaks the line there.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

FIRST_CURVES = (
    "rollout/reward_mean", "rollout/accuracy", "train/loss", "train/grad_norm", "train/entropy",
    "train/train_rollout_logprob_abs_diff", "rollout/response_len_mean", "eval/accuracy",
)
"""Drawn first, in this order, when the run logged them; every other metric follows, folded."""

WIDTH, HEIGHT, PAD_X, PAD_Y = 300, 120, 58, 16


def metric_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float | None]]]:
    """``{metric: [(step, value or None)]}`` for every numeric metric, in first-seen order."""
    series: dict[str, list[tuple[int, float | None]]] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key in ("step", "time"):
                continue
            if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                number = float(value) if value is not None and math.isfinite(float(value)) else None
                series.setdefault(key, []).append((step, number))
    return {k: v for k, v in series.items() if any(value is not None for _, value in v)}


def curves_html(records: list[dict[str, Any]]) -> str:
    series = metric_series(records)
    if not series:
        return '<p class="note">No metrics: the run folder has no readable metrics.jsonl.</p>'
    first = [k for k in FIRST_CURVES if k in series]
    rest = [k for k in series if k not in first]
    html = ['<div class="curves">', *(chart_svg(k, series[k]) for k in first), "</div>"]
    if rest:
        html += [f"<details><summary>{len(rest)} more metrics</summary>", '<div class="curves">',
                 *(chart_svg(k, series[k]) for k in rest), "</div></details>"]
    return "\n".join(html)


def chart_svg(name: str, points: list[tuple[int, float | None]]) -> str:
    values = [v for _, v in points if v is not None]
    steps = [s for s, _ in points]
    low, high = min(values), max(values)
    span_y = (high - low) or (abs(high) or 1.0)
    first, last = min(steps), max(steps)
    span_x = (last - first) or 1

    def xy(step: int, value: float) -> tuple[float, float]:
        x = PAD_X + (step - first) / span_x * (WIDTH - PAD_X - 8)
        y = HEIGHT - PAD_Y - (value - low) / span_y * (HEIGHT - 2 * PAD_Y)
        return round(x, 1), round(y, 1)

    lines: list[list[tuple[float, float]]] = [[]]
    dots = []
    for step, value in points:
        if value is None:
            lines.append([])
            continue
        x, y = xy(step, value)
        lines[-1].append((x, y))
        dots.append(f'<circle cx="{x}" cy="{y}" r="2"><title>step {step}: {value:.6g}</title></circle>')
    paths = "".join(
        f'<polyline points="{" ".join(f"{x},{y}" for x, y in line)}"/>' for line in lines if len(line) > 1
    )
    label = escape(name)
    bottom = HEIGHT - PAD_Y
    return (
        f'<figure class="curve"><figcaption>{label}</figcaption>'
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{label}">'
        f'<line class="axis" x1="{PAD_X}" y1="{PAD_Y}" x2="{PAD_X}" y2="{bottom}"/>'
        f'<line class="axis" x1="{PAD_X}" y1="{bottom}" x2="{WIDTH - 8}" y2="{bottom}"/>'
        f'<text x="{PAD_X - 4}" y="{PAD_Y + 4}" text-anchor="end">{high:.3g}</text>'
        f'<text x="{PAD_X - 4}" y="{bottom}" text-anchor="end">{low:.3g}</text>'
        f'<text x="{PAD_X}" y="{HEIGHT - 2}">step {first}</text>'
        f'<text x="{WIDTH - 8}" y="{HEIGHT - 2}" text-anchor="end">step {last}</text>'
        f'<g class="line">{paths}</g><g class="dot">{"".join(dots)}</g></svg></figure>'
    )
