"""``predict``: a trained model's lanes on images or a video on a volume, from the UI or code.

The model is named the way people think of it — ``champion`` (the current champion of the volume), a
run (``train-1a2b3c4d5e6f``), a snapshot, or a package path on the volume — and resolved to its package.
The input (an image, a folder, a glob or a video file) and the output folder are paths on the volume.
Ends with an artifact: what ran, how many frames, what was skipped, and the first overlay.
"""

from __future__ import annotations

import re
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run as current_run
from prefect.variables import Variable

from tasks.champion import champion_variable
from tasks.names import validate_name
from tasks.pipeline import predict as predict_task
from tasks.platforms import Platform, VolumeRef, load_platform

RUN_NAME = re.compile(r"^(train|restore)-[0-9a-f]{12}$")


class ModelNotFound(LookupError):
    """A model name that resolves to no package; says what was tried and what to do."""


def resolve_package(platform: Platform, volume: str, model: str) -> tuple[str, str]:
    """``(volume, package path on it)`` for ``champion``, a run, a snapshot or a package path."""
    if model == "champion":
        record = Variable.get(champion_variable(volume), default=None)
        if not record:
            raise ModelNotFound(f"volume '{volume}' has no champion yet: run nightly_retrain on it, or name a run")
        if not record.get("package"):
            raise ModelNotFound(f"the champion of '{volume}' ({record.get('run')}) was trained without a package; "
                                "run it again with package on")
        return record.get("volume") or volume, record["package"]
    if RUN_NAME.match(model):
        return volume, f"runs/{model}/package"
    try:
        lineage = platform.find_lineage(model)
    except KeyError:
        lineage = None
    if lineage is not None:  # a snapshot: the package of its run, on the volume it was taken of
        return lineage.get("volume") or volume, lineage.get("package") or f"{lineage['run_dir']}/package"
    if model.startswith("/") or ".." in model.split("/"):
        raise ModelNotFound(f"model '{model}' is not champion, a run, a snapshot or a package path on the volume")
    return volume, model


@flow(name="predict")
def predict(inputs: str, model: str = "champion", volume: str = "tusimple", platform: str = "local",
            backend: str = "auto", output: str | None = None) -> dict[str, Any]:
    """Predict lanes on ``inputs`` (a path on the volume) with ``model``; lines and overlays under ``output``."""
    logger = get_run_logger()
    validate_name(volume, "volume")
    chosen = load_platform(platform)
    volume, package = resolve_package(chosen, volume, model)
    out_dir = output or f"predictions/{current_run.name}"
    ref = VolumeRef(name=volume, location=volume)
    logger.info("model %s -> package %s on volume %s", model, package, volume)
    summary = predict_task(chosen, ref, package, inputs, out_dir, backend)
    skipped = "".join(f"\n- `{item['frame']}`: {item['problem']}" for item in summary["skipped"][:20])
    create_markdown_artifact(
        key="predict", description=f"lanes predicted on {inputs} with {model}",
        markdown=f"# Lanes on `{inputs}`\n\n| | |\n|---|---|\n| model | `{model}` (package `{package}`) |\n"
                 f"| backend | {summary['backend']} |\n| frames | {summary['frames']} read, {summary['predicted']} "
                 f"predicted, {len(summary['skipped'])} skipped |\n| speed | {summary['img_per_s']} img/s |\n"
                 f"| prediction lines | `{summary['predictions']}` on volume `{volume}` |\n"
                 f"| overlays | `{summary['overlay']}` |\n" + (f"\nSkipped:{skipped}\n" if skipped else ""))
    return {**summary, "volume": volume, "package": package, "model": model}
