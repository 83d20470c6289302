"""Pure builders for what a run publishes: the metrics table, the training-curve PNG (matplotlib),
the package description, image embedding.

Nothing here talks to Prefect or the disk; the publish task hands the results to Prefect's artifact API.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import cv2
import numpy as np

from tasks.champion import FP_ONLY_SCENARIOS


def step_series(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The ``step`` events of a run, one per logged step (a resumed run logs some steps twice: last wins)."""
    by_step: dict[int, dict[str, float]] = {}
    for event in events:
        if event.get("event") == "step":
            by_step[int(event["step"])] = event
    return [by_step[step] for step in sorted(by_step)]


def metrics_rows(training: dict[str, Any], evaluation: dict[str, Any], steps: list[dict[str, Any]]) -> list[dict]:
    """The metrics table: the evaluation's scores (CULane's or TuSimple's, ``evaluation_rows``), then how
    training went."""
    rows = evaluation_rows(evaluation)
    if steps:
        rows += [
            {"metric": "final loss", "value": round(float(steps[-1]["loss"]), 4)},
            {"metric": "mean img/s", "value": round(float(np.mean([s["img_per_s"] for s in steps])), 2)},
            {"metric": "mean input stall", "value": round(float(np.mean([s["input_stall"] for s in steps])), 4)},
        ]
    rows += [{"metric": key, "value": training[key]} for key in ("steps", "resumed_from", "duration_s")
             if key in training]
    return rows


def evaluation_rows(evaluation: dict[str, Any]) -> list[dict]:
    """An evaluation's scores as table rows, named as its benchmark names them: a CULane run's F1 is not
    TuSimple's accuracy, and its ``fp`` (1 - precision) is not TuSimple's FP rate."""
    if evaluation.get("metric") == "culane":
        return culane_rows(evaluation)
    split = evaluation.get("split", "eval")
    names = {"accuracy": "accuracy (official)", "fp": "FP (official)", "fn": "FN (official)",
             "untimed_accuracy": "accuracy without the 200 ms rule (model selection)",
             "untimed_fp": "FP without the 200 ms rule", "untimed_fn": "FN without the 200 ms rule"}
    rows = [{"metric": f"{split} {label}", "value": round(float(evaluation[name]), 4)}
            for name, label in names.items() if name in evaluation]
    for name, label in (("images", "images"), ("over_time_limit", "images over 200 ms")):
        if name in evaluation:
            rows.append({"metric": f"{split} {label}", "value": evaluation[name]})
    return rows


#: A CULane figure that is undefined (no lane to find and none predicted), as the table shows it.
UNDEFINED = "undefined (nothing to count)"


def _figure(value: Any) -> float | str:
    return UNDEFINED if value is None else round(float(value), 4)


def culane_rows(evaluation: dict[str, Any]) -> list[dict]:
    """CULane's official figures over the whole split (F1, precision and recall at IoU 0.5, F1 at 0.75, the mean
    F1 over 0.5:0.95, the lane counts), then each scenario list's F1 — the crossroads' false positives instead,
    the only figure the official tool gives them (they have no lanes)."""
    split = evaluation.get("split", "eval")
    total = evaluation.get("counts") or {"f1": evaluation.get("accuracy")}
    rows = [{"metric": f"{split} {label}", "value": _figure(total.get(key))}
            for key, label in (("f1", "F1 (official, IoU 0.5; model selection)"), ("precision", "precision"),
                               ("recall", "recall"), ("f1_75", "F1 at IoU 0.75"),
                               ("mean_f1", "mean F1 (IoU 0.5:0.95)")) if key in total]
    rows += [{"metric": f"{split} {label}", "value": int(total[key])}
             for key, label in (("tp", "true positive lanes"), ("fp", "false positive lanes"),
                                ("fn", "missed lanes")) if total.get(key) is not None]
    if "images" in evaluation:
        rows.append({"metric": f"{split} images", "value": evaluation["images"]})
    for name, figures in (evaluation.get("scenarios") or {}).items():
        if name in FP_ONLY_SCENARIOS:
            rows.append({"metric": f"{split} {name} false positive lanes (no lanes to find)",
                         "value": int(figures.get("fp") or 0)})
        else:
            rows.append({"metric": f"{split} {name} F1", "value": _figure(figures.get("f1"))})
    return rows


def validation_score_name(evaluation: dict[str, Any]) -> str:
    """What the trainer's validation scores are: CULane's F1 (IoU 0.5) or TuSimple's untimed accuracy."""
    return "validation F1" if evaluation.get("metric") == "culane" else "validation accuracy"


def metrics_description(evaluation: dict[str, Any], run: str) -> str:
    """The metrics table's description: which benchmark's figures it holds."""
    benchmark = "CULane" if evaluation.get("metric") == "culane" else "TuSimple"
    return f"{benchmark} metrics and training summary of {run}"


def eval_series(events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, validation accuracy) of every evaluation a run reported (the trainer's ``eval`` events,
    placed at the step of the epoch or checkpoint before them)."""
    points, step = [], 0
    for event in events:
        if event.get("event") in ("step", "epoch", "checkpoint", "done") and "step" in event:
            step = int(event["step"])
        elif event.get("event") == "eval" and "accuracy" in event:
            points.append((step, float(event.get("untimed_accuracy", event["accuracy"]))))
    return points


def world_changes(steps: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(step, workers) where an elastic run's logged steps change their worker count (none for a fixed run)."""
    changes, current = [], None
    for event in steps:
        workers = event.get("workers")
        if workers is not None and current is not None and workers != current:
            changes.append((int(event["step"]), int(workers)))
        current = workers if workers is not None else current
    return changes


def training_curve_png(steps: list[dict[str, Any]], title: str,
                       validation: list[tuple[int, float]] | None = None,
                       score_name: str = "validation accuracy") -> bytes:
    """Loss and learning rate on their own axes, per-epoch validation score (``score_name``: TuSimple's accuracy,
    CULane's F1) below when known (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to memory only
    from matplotlib.figure import Figure

    rows = 2 if validation else 1
    figure = Figure(figsize=(8, 3.4 * rows), dpi=100, layout="constrained")
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    loss_axis = axes[0]
    loss_axis.set_title(title, fontsize=11)
    if not steps:
        loss_axis.text(0.5, 0.5, "no steps logged", ha="center", va="center", transform=loss_axis.transAxes)
    else:
        x = [s["step"] for s in steps]
        loss_axis.plot(x, [s["loss"] for s in steps], color="tab:orange", marker=".", label="loss")
        loss_axis.set_ylabel("loss", color="tab:orange")
        loss_axis.tick_params(axis="y", labelcolor="tab:orange")
        lr_axis = loss_axis.twinx()
        lr_axis.plot(x, [s["lr"] for s in steps], color="tab:green", linestyle="--", label="learning rate")
        lr_axis.set_ylabel("learning rate", color="tab:green")
        lr_axis.tick_params(axis="y", labelcolor="tab:green")
        lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        loss_axis.grid(alpha=0.3)
        for step, workers in world_changes(steps):  # an elastic run: where it lost or took back workers
            loss_axis.axvline(step, color="tab:gray", linestyle=":", linewidth=1)
            loss_axis.annotate(f"{workers} worker{'s' if workers != 1 else ''}", (step, 1.0),
                               xycoords=("data", "axes fraction"), xytext=(2, -10), textcoords="offset points",
                               fontsize=8, color="tab:gray")
    if validation:
        axis = axes[1]
        axis.plot([s for s, _ in validation], [a for _, a in validation], color="tab:blue", marker="o")
        axis.set_ylabel(score_name)
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def render_package_markdown(package: dict[str, Any], volume: str, lineage: dict[str, Any]) -> str:
    """What a model package is, where it lives and how well its model does (the UI artifact)."""
    metrics = lineage.get("metrics") or {}
    parity = package.get("parity", {})
    backends = parity.get("backends", {})
    lines = [
        f"# Model package of `{lineage.get('run')}`",
        "",
        "SCNN exported for use outside laneflow: weights, TorchScript and ONNX of the deployable module "
        "(uint8 BGR images in, lane probabilities and existence out), its input contract, lineage and test "
        "metrics, every file checksummed.",
        "",
        "| | |",
        "|---|---|",
        f"| folder | `{package.get('package')}` on volume `{volume}` |",
        f"| archive | `{package.get('archive')}` |",
        f"| format version | {package.get('format_version')} |",
        f"| dataset version | `{lineage.get('dataset_version')}` |",
        *(f"| {metrics.get('split', 'test')} {label} | {float(metrics[key]):.4f} |"
          for key, label in headline_scores(metrics) if key in metrics),
        f"| parity | checked on {parity.get('images')} images, tolerance {parity.get('tolerance')}: " + ", ".join(
            f"{name} max difference {r['max_abs_diff']:.1e}, lanes "
            f"{'identical' if r['identical_lanes'] else 'DIFFER'}" for name, r in backends.items()) + " |",
        *(f"| `{name}` | sha256 `{digest}` |" for name, digest in sorted((package.get("files") or {}).items())),
        "",
        f"Run it: `laneflow predict <images or video> --model {lineage.get('run')} --volume {volume}`",
    ]
    return "\n".join(lines) + "\n"


def headline_scores(metrics: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """(key, label) of the scores a summary shows: CULane's F1 (its ``accuracy`` key), TuSimple's accuracy with
    and without the 200 ms rule."""
    if metrics.get("metric") == "culane":
        return (("accuracy", "F1 (official, IoU 0.5)"),)
    return (("accuracy", "accuracy (official)"), ("untimed_accuracy", "accuracy without the 200 ms rule"))


def thumbnail_jpeg(image_bytes: bytes, max_width: int = 960) -> bytes:
    """A smaller JPEG of an image, small enough to embed in an artifact."""
    image = cv2.imdecode(np.frombuffer(image_bytes, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError("not a decodable image")
    if image.shape[1] > max_width:
        scale = max_width / image.shape[1]
        image = cv2.resize(image, (max_width, round(image.shape[0] * scale)), interpolation=cv2.INTER_AREA)
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 85])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return encoded.tobytes()


def data_uri(data: bytes, mime: str) -> str:
    """Inline an image into markdown: artifacts then show it without any file server."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
