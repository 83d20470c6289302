"""A model package put into an MLflow run's artifacts, from where the package lies (a pod on the claim).

On a cluster the package is on the claim, which the flow's process cannot read as files; this runs as a
Job in the training image with the claim mounted, checks the package (format and every file's checksum:
only a package that loads is published) and uploads its folder under the run's ``package`` artifact
path with MLflow's own client, so a registered version ``runs:/<run id>/package`` is the loadable package.

    python -m training.publish_package --package P --tracking-uri URI --run-id ID [--artifact-path package]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from training.package import PackageError, load_package
from training.signals import exit_on_sigterm


def main(argv: list[str] | None = None) -> int:
    """``python -m training.publish_package``: check a package folder and log it to an MLflow run."""
    parser = argparse.ArgumentParser(prog="python -m training.publish_package", description=main.__doc__)
    parser.add_argument("--package", required=True, type=Path, help="the package folder (runs/<run>/package)")
    parser.add_argument("--tracking-uri", required=True, help="the MLflow tracking server, as this pod reaches it")
    parser.add_argument("--run-id", required=True, help="the MLflow run to log the package to")
    parser.add_argument("--artifact-path", default="package", help="where in the run's artifacts it goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    try:
        package = load_package(args.package)
    except PackageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        print("error: mlflow is not installed in this image: build it with the mlflow extra "
              "(pip install '.[mlflow]')", file=sys.stderr)
        return 2
    MlflowClient(tracking_uri=args.tracking_uri).log_artifacts(args.run_id, str(package.folder), args.artifact_path)
    files = sorted(path.name for path in package.folder.iterdir() if path.is_file())
    print(json.dumps({"event": "published", "run_id": args.run_id, "artifact_path": args.artifact_path,
                      "files": files}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
