"""``make clean`` and ``make clean-work``: caches are cheap to lose, trained work is not.

``caches`` removes only what the next command makes again by itself: Python's, pytest's and ruff's caches in the
project. Nothing under the demo's folder: its synthetic archives and downloads are what a server still running
(``make serve``) trains from, its volumes' datasets and runs, snapshots and the Prefect server's history (runs,
champions, variables, deployments) are work — kept, and said so.

``work`` deletes the demo's trained work and history — every volume, snapshot, champion and study and the Prefect
database — but only when asked twice: without ``--yes`` it lists what it would delete and exits 1.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

#: Project folders never searched for __pycache__ (a virtual environment's own caches are its business).
NOT_SEARCHED = {".venv", ".git", "node_modules", ".laneflow"}


def cache_paths(root: Path, demo_dir: Path) -> list[Path]:
    """What ``caches`` removes under the project ``root``: existing paths only (nothing of ``demo_dir``, even where it
    lies inside the project)."""
    found = [root / ".pytest_cache", root / ".ruff_cache", *_pycaches(root, demo_dir.resolve())]
    return [path for path in found if path.exists()]


def _pycaches(root: Path, demo_dir: Path) -> Iterator[Path]:
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        if not child.is_dir() or child.is_symlink() or child.name in NOT_SEARCHED or child.resolve() == demo_dir:
            continue
        if child.name == "__pycache__":
            yield child
        else:
            yield from _pycaches(child, demo_dir)


def work_paths(demo_dir: Path) -> list[tuple[Path, str]]:
    """What ``work`` deletes, each with what it is to a user."""
    home = demo_dir / "home"
    described = [(path, f"volume {path.name}: {_count(path / 'runs')} run(s), {_count(path / 'datasets')} "
                        "prepared dataset(s), its studies")
                 for path in sorted((home / "volumes").glob("*")) if path.is_dir()]
    described += [(path, f"snapshot {path.name}") for path in sorted((home / "snapshots").glob("*")) if path.is_dir()]
    if (demo_dir / "source").exists():
        described.append((demo_dir / "source", "the demo's synthetic dataset archives (made again by make demo)"))
    if (demo_dir / "prefect").exists():
        described.append((demo_dir / "prefect", "the Prefect server's history: flow runs, champions, variables, "
                                                "deployments, concurrency limits"))
    return described


def _count(folder: Path) -> int:
    return sum(1 for child in folder.iterdir() if child.is_dir()) if folder.is_dir() else 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/clean.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("caches", "work"))
    parser.add_argument("--demo-dir", type=Path, required=True, help="the demo's folder (make's DEMO_DIR)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the project")
    parser.add_argument("--yes", action="store_true", help="work: delete it (without: list it, delete nothing)")
    args = parser.parse_args(argv)
    if args.what == "caches":
        for path in cache_paths(args.root, args.demo_dir):
            _remove(path)
            print(f"removed {path}")
        print(f"kept: volumes, snapshots and the Prefect history under {args.demo_dir} "
              "('make clean-work' deletes them)")
        return 0
    doomed = work_paths(args.demo_dir)
    if not doomed:
        print(f"nothing to delete under {args.demo_dir}")
        return 0
    for path, what in doomed:
        print(f"{'deleting' if args.yes else 'would delete'} {path}  ({what})")
    if not args.yes:
        print("nothing deleted: this is trained work and history. Delete it with 'make clean-work CONFIRM=yes'.",
              file=sys.stderr)
        return 1
    for path, _ in doomed:
        _remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
