"""PNG plots of benchmark and simulator results (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt

COLORS = {
    "direct": "#1b7837",
    "compat": "#5aae61",
    "naive_store": "#d6604d",
    "naive_store_full": "#b2182b",
    "broadcast": "#4393c3",
    "nccl_broadcast": "#4393c3",
}


def _bars(axis: Any, names: list[str], values: list[float], title: str, unit: str) -> None:
    bars = axis.bar(names, values, color=[COLORS.get(n, "grey") for n in names])
    axis.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
    axis.set_title(title, fontsize=10)
    axis.set_ylabel(unit)
    axis.tick_params(axis="x", labelrotation=30, labelsize=8)


def _grouped_bars(
    axis: Any,
    names: list[str],
    approaches: Mapping[str, Mapping[str, float]],
    metrics: tuple[str, ...],
    scale: float,
    title: str,
) -> None:
    """One bar per metric for every approach, side by side, each divided by ``scale``."""
    width = 0.8 / len(metrics)
    for index, metric in enumerate(metrics):
        xs = [i + (index - 1) * width for i in range(len(names))]
        axis.bar(xs, [approaches[n][metric] / scale for n in names], width, label=metric)
    axis.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8)


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_compare(result: Mapping[str, Any], path: Path) -> Path:
    """Seconds, model GB/s against the machine's ceilings, and bytes per model byte."""
    approaches = result["approaches"]
    names = list(approaches)
    model = result["model_bytes"]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    _bars(axes[0], names, [approaches[n]["seconds"] for n in names], "update time", "seconds")
    _bars(axes[1], names, [approaches[n]["gbps"] for n in names], "model GB/s", "GB/s")
    for label, style in (("memcpy_gbps", "--"), ("raw_te_gbps", ":")):
        value = result["ceilings"][label]
        axes[1].axhline(
            value, color="black", linestyle=style, linewidth=1, label=f"{label} {value}"
        )
    axes[1].legend(fontsize=8)
    _grouped_bars(
        axes[2],
        names,
        approaches,
        ("store_read_bytes", "pushed_bytes", "max_node_nic_bytes"),
        model,
        "bytes / model bytes",
    )
    config = result["config"]
    figure.suptitle(
        f"{model / 2**20:.0f} MiB bf16 model, {config['workers']} workers on "
        f"{config['nodes']} node labels, one host (TCP loopback)",
        fontsize=11,
    )
    return _save(figure, path)


def plot_simulation(result: Mapping[str, Any], path: Path) -> Path:
    """Estimated update seconds per approach, split into the model's stages."""
    approaches = result["approaches"]
    names = list(approaches)
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    _bars(
        axes[0],
        names,
        [approaches[n]["update_seconds"] for n in names],
        "estimated update seconds",
        "seconds",
    )
    axes[0].set_yscale("log")
    _grouped_bars(
        axes[1],
        names,
        approaches,
        ("store_read_bytes", "max_trainer_node_nic_out_bytes", "max_rollout_gpu_nic_in_bytes"),
        1e12,
        "TB (log scale)",
    )
    axes[1].set_yscale("log")
    scenario = result["scenario"]
    figure.suptitle(scenario["summary"], fontsize=11)
    return _save(figure, path)


def plot_load(
    result: Mapping[str, Any], samples: Mapping[str, list[Mapping[str, Any]]], path: Path
) -> Path:
    """Per rotation and drain mode: each request's latency at the time it ended, updates
    shaded."""
    runs = [(mode, drain) for mode, drains in result["modes"].items() for drain in drains]
    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    marks = {"ok": ("#1b7837", "."), "aborted": ("#fdae61", "x"), "failed": ("#b2182b", "x")}
    for axis, (mode, drain) in zip(axes[:, 0], runs, strict=True):
        report = result["modes"][mode][drain]
        for start, end in report["spans"]:
            axis.axvspan(start, end, color="#4393c3", alpha=0.2)
        for outcome, (color, marker) in marks.items():
            rows = [s for s in samples[f"{mode}/{drain}"] if s["outcome"] == outcome]
            axis.scatter(
                [s["ended"] for s in rows],
                [s["ended"] - s["started"] for s in rows],
                s=8,
                c=color,
                marker=marker,
                label=f"{outcome} ({len(rows)})",
            )
        axis.set_title(
            f"{mode}, drain {drain}: {report['failed']} failed, {report['aborted']} aborted, "
            f"{report['kept']} kept; pause max {report['pause_s']['max']} s, landing max "
            f"{report['landing_s']['max']} s (shaded: updates)",
            fontsize=10,
        )
        axis.set_xlabel("seconds")
        axis.set_ylabel("latency (s)")
        axis.legend(fontsize=8, loc="upper right")
    return _save(figure, path)
