"""Pure builders for what a run publishes: the metrics table, the training-curve PNG, image embedding.

Nothing here talks to Prefect or the disk; the publish task hands the results to Prefect's artifact API.
"""

from __future__ import annotations

import base64
from typing import Any

import cv2
import numpy as np

CURVE_SIZE = (800, 360)
_MARGIN = (70, 20, 30, 50)  # left, right, top, bottom


def step_series(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The ``step`` events of a run, one per logged step (a resumed run logs some steps twice: last wins)."""
    by_step: dict[int, dict[str, float]] = {}
    for event in events:
        if event.get("event") == "step":
            by_step[int(event["step"])] = event
    return [by_step[step] for step in sorted(by_step)]


def metrics_rows(training: dict[str, Any], evaluation: dict[str, Any], steps: list[dict[str, Any]]) -> list[dict]:
    """The metrics table: TuSimple scores, then how training went."""
    split = evaluation.get("split", "eval")
    names = {"accuracy": "accuracy (official)", "fp": "FP (official)", "fn": "FN (official)",
             "untimed_accuracy": "accuracy without the 200 ms rule (model selection)",
             "untimed_fp": "FP without the 200 ms rule", "untimed_fn": "FN without the 200 ms rule"}
    rows = [{"metric": f"{split} {label}", "value": round(float(evaluation[name]), 4)}
            for name, label in names.items() if name in evaluation]
    for name, label in (("images", "images"), ("over_time_limit", "images over 200 ms")):
        if name in evaluation:
            rows.append({"metric": f"{split} {label}", "value": evaluation[name]})
    if steps:
        rows += [
            {"metric": "final loss", "value": round(float(steps[-1]["loss"]), 4)},
            {"metric": "mean img/s", "value": round(float(np.mean([s["img_per_s"] for s in steps])), 2)},
            {"metric": "mean input stall", "value": round(float(np.mean([s["input_stall"] for s in steps])), 4)},
        ]
    rows += [{"metric": key, "value": training[key]} for key in ("steps", "resumed_from", "duration_s")
             if key in training]
    return rows


def training_curve_png(steps: list[dict[str, Any]], title: str) -> bytes:
    """Loss (and learning rate, scaled to the same box) against step, as PNG bytes."""
    width, height = CURVE_SIZE
    left, right, top, bottom = _MARGIN
    image = np.full((height, width, 3), 255, np.uint8)
    box_w, box_h = width - left - right, height - top - bottom
    cv2.rectangle(image, (left, top), (left + box_w, top + box_h), (90, 90, 90), 1)
    cv2.putText(image, title, (left, top - 8), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (20, 20, 20), 1, cv2.LINE_AA)
    if not steps:
        cv2.putText(image, "no steps logged", (left + 20, top + box_h // 2), cv2.FONT_HERSHEY_SIMPLEX, 0.6,
                    (60, 60, 60), 1, cv2.LINE_AA)
        return _png(image)
    x = np.array([s["step"] for s in steps], float)
    series = {"loss": (np.array([s["loss"] for s in steps], float), (200, 80, 30)),
              "lr (scaled)": (np.array([s["lr"] for s in steps], float), (60, 160, 60))}
    x_lo, x_hi = float(x.min()), float(max(x.max(), x.min() + 1))
    loss = series["loss"][0]
    y_lo, y_hi = 0.0, float(max(loss.max(), 1e-6)) * 1.05
    for label, (values, colour) in series.items():
        if label.startswith("lr"):
            values = values / max(values.max(), 1e-12) * y_hi * 0.9
        px = left + (x - x_lo) / (x_hi - x_lo) * box_w
        py = top + box_h - (values - y_lo) / (y_hi - y_lo) * box_h
        points = np.stack([px, py], axis=1).round().astype(np.int32)
        cv2.polylines(image, [points], False, colour, 2, cv2.LINE_AA)
        for point in points:
            cv2.circle(image, tuple(int(v) for v in point), 2, colour, -1)
    for fraction in (0.0, 0.5, 1.0):
        y_value = y_lo + fraction * (y_hi - y_lo)
        y_pixel = int(top + box_h - fraction * box_h)
        cv2.putText(image, f"{y_value:.3g}", (8, y_pixel + 4), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (40, 40, 40), 1,
                    cv2.LINE_AA)
        x_value = x_lo + fraction * (x_hi - x_lo)
        x_pixel = int(left + fraction * box_w)
        cv2.putText(image, f"{x_value:.0f}", (x_pixel - 10, top + box_h + 18), cv2.FONT_HERSHEY_SIMPLEX, 0.4,
                    (40, 40, 40), 1, cv2.LINE_AA)
    cv2.putText(image, "step", (left + box_w // 2 - 15, height - 8), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (40, 40, 40), 1,
                cv2.LINE_AA)
    for row, (label, (_, colour)) in enumerate(series.items()):
        y_pixel = top + 18 + 18 * row
        cv2.line(image, (left + box_w - 120, y_pixel - 4), (left + box_w - 100, y_pixel - 4), colour, 2)
        cv2.putText(image, label, (left + box_w - 95, y_pixel), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (30, 30, 30), 1,
                    cv2.LINE_AA)
    return _png(image)


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


def _png(image: np.ndarray) -> bytes:
    ok, encoded = cv2.imencode(".png", image)
    if not ok:
        raise ValueError("PNG encoding failed")
    return encoded.tobytes()
