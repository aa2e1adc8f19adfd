"""`codeloop view RUN_DIR`: one static HTML file to browse a run's trajectories and metrics.

It reads, anywhere under RUN_DIR: training dumps (`trajectories/step_N.jsonl`), evaluation
trajectories (`trajectories.jsonl`), token entropies (`entropy.json` from `codeloop entropy`,
shown as colours) and `metrics.jsonl` (plotted as inline SVG, one chart per metric, stages
one after another). The page needs no server and loads nothing from the network; model text is
inserted as text, never parsed as HTML. Filters: source, status and reward, also from the URL
fragment (`view.html#status=answered&reward=1`).

A large run holds more trajectories than a page can show: the newest `max_trajectories` are
embedded and the page and the command say how many were left out.
"""

from __future__ import annotations

import html
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from codeloop.data.problems import DataError
from codeloop.errors import InputFileError

TEMPLATE = Path(__file__).with_name("viewer.html")
_BULKY = ("prompt_ids", "response_ids", "loss_mask", "logprobs")
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not JSON ({err.msg})") from err


def _trajectory_files(run_dir: Path) -> list[tuple[str, Path]]:
    """(source name, file), oldest first: training steps in order, then evaluations."""
    steps = sorted(run_dir.rglob("trajectories/step_*.jsonl"), key=lambda p: (p.parent, p.name))
    evals = sorted(run_dir.rglob("trajectories.jsonl"))
    named = [(f"{_rel(p.parent.parent, run_dir)} step {int(p.stem[5:])}", p) for p in steps]
    return named + [(_rel(p.parent, run_dir), p) for p in evals]


def _rel(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path != root else "."


def _entropies(path: Path) -> tuple[dict[tuple[str, int], Any], dict[str, Any] | None]:
    entropy_file = path.with_name("entropy.json")
    if not entropy_file.exists():
        return {}, None
    data = json.loads(entropy_file.read_text())
    tokens = {(t["prompt_id"], t["sample_index"]): t["tokens"] for t in data["trajectories"]}
    return tokens, data["report"]


def collect_trajectories(
    run_dir: Path, max_trajectories: int
) -> tuple[list[dict[str, Any]], int, dict[str, Any] | None]:
    """The newest `max_trajectories` records (oldest first), how many in all, entropy report."""
    kept: list[dict[str, Any]] = []
    total, report = 0, None
    for source, path in reversed(_trajectory_files(run_dir)):
        if len(kept) >= max_trajectories:  # older files are only counted, not parsed
            total += sum(1 for line in path.read_text().splitlines() if line.strip())
            continue
        entropy, file_report = _entropies(path)
        report = report or file_report
        for record in reversed(list(_jsonl(path))):  # newest first; reversed back at the end
            total += 1
            if len(kept) >= max_trajectories:
                continue
            view = {k: v for k, v in record.items() if k not in _BULKY}
            view.setdefault("response_tokens", len(record.get("response_ids", [])))
            view["source"] = source
            key = (record["prompt_id"], record["sample_index"])
            if key in entropy:
                view["entropy"] = entropy[key]
            kept.append(view)
    return kept[::-1], total, report


def metric_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> (x, value) over all `metrics.jsonl` files, stages one after another."""
    series: dict[str, list[tuple[int, float]]] = {}
    offset = 0
    for path in sorted(run_dir.rglob("metrics.jsonl")):
        last = 0
        for record in _jsonl(path):
            last = max(last, int(record.get("step", 0)))
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    series.setdefault(key, []).append((offset + int(record["step"]), value))
        offset += last
    return series


def svg_plot(
    name: str, points: Sequence[tuple[int, float]], width: int = 260, height: int = 110
) -> str:
    """A small line chart with its name, range and last value."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 10) / (x1 - x0 or 1)
    sy = (height - 30) / (y1 - y0 or 1)
    coords = " ".join(
        f"{5 + (x - x0) * sx:.1f},{height - 5 - (y - y0) * sy:.1f}" for x, y in points
    )
    colour = _COLOURS[zlib.crc32(name.split("/")[0].encode()) % len(_COLOURS)]
    return (
        f'<div class="plot" data-metric="{html.escape(name)}"><div class="name">'
        f"{html.escape(name)}: {ys[-1]:.4g} (range {y0:.4g} to {y1:.4g})</div>"
        f'<svg width="{width}" height="{height}"><polyline fill="none" stroke="{colour}" '
        f'stroke-width="1.5" points="{coords}"/></svg></div>'
    )


def render(run_dir: str | Path, max_trajectories: int = 2000) -> tuple[str, int, int]:
    """(page, trajectories shown, trajectories found)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise InputFileError(f"no such run directory: {root}")
    trajectories, total, report = collect_trajectories(root, max_trajectories)
    if not total:
        raise InputFileError(
            f"{root}: no trajectories in it or below it (a training run's "
            "trajectories/step_*.jsonl, codeloop eval's trajectories.jsonl)"
        )
    series = metric_series(root)
    plots = "".join(svg_plot(k, v) for k, v in sorted(series.items()))
    scale = max(
        (h for t in trajectories for _, h in t.get("entropy", []) if h is not None), default=1.0
    )
    data = {
        "trajectories": trajectories,
        "max_shown": 500,
        "entropy_report": report,
        "entropy_scale": scale or 1.0,
    }
    payload = json.dumps(data).replace("</", "<\\/")  # no `</script>` inside the script tag
    page = (
        TEMPLATE.read_text()
        .replace("__TITLE__", html.escape(root.name or str(root)))
        .replace("__PLOTS__", f'<div class="plots">{plots}</div>' if plots else "no metrics")
        .replace("__DATA__", payload)
    )
    return page, len(trajectories), total
