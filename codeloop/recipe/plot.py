"""The curves of a recipe's points (`curves.png`): accuracy, response length and the tool-error
ratio among correct answers, stage by stage, with each point's 95% interval where it has one.
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
        ("accuracy", "response_tokens", "tool_error_ratio_correct"),
        ("held-out accuracy", "mean response tokens", "tool-error ratio among correct"),
        strict=True,
    ):
        values = [p[key] for p in points]
        bounds = [p.get(key + "_interval95") for p in points]
        if all(bounds):  # the 95% interval as error bars
            below = [v - b[0] for v, b in zip(values, bounds, strict=True)]  # type: ignore[index]
            above = [b[1] - v for v, b in zip(values, bounds, strict=True)]  # type: ignore[index]
            ax.errorbar(stages, values, yerr=[below, above], marker="o", capsize=4)
        else:
            ax.plot(stages, values, marker="o")
        ax.set_title(title + (" (95% interval)" if all(bounds) else ""))
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
