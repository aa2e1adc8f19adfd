"""The curves of a recipe's points (`curves.png`): pass@1, response length and the tool-error
ratio among correct answers, stage by stage, pass@1 with its 95% interval.
`codeloop demo` and `codeloop real` draw theirs with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [p["stage"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, key, title in zip(
        axes,
        ("pass@1", "response_tokens", "tool_error_ratio_correct"),
        ("held-out pass@1", "mean response tokens", "tool-error ratio among correct"),
        strict=True,
    ):
        values = [p[key] for p in points]
        if key + "_low" in points[0]:  # the 95% interval as error bars
            below = [v - p[key + "_low"] for v, p in zip(values, points, strict=True)]
            above = [p[key + "_high"] - v for v, p in zip(values, points, strict=True)]
            ax.errorbar(stages, values, yerr=[below, above], marker="o", capsize=4)
            title += " (95% interval)"
        else:
            ax.plot(stages, values, marker="o")
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
