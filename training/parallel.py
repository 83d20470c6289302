"""Worker processes that are safe to start from any caller (CLI, Prefect task, trainer).

Never fork: the parent may hold OpenCV's thread pool or Prefect's threads, and a forked child
inherits their locks mid-use. A fork server starts clean once and forks cheaply afterwards. An
executor (unlike ``multiprocessing.Pool``) fails loudly when a worker dies instead of hanging.

A fork server's workers import the parent's ``__main__`` first (multiprocessing's rule for every
start method but fork), so laneflow starts these pools only in its own processes (``python -m
training.data.prepare``, the trainer, evaluation): a script that calls a flow needs no ``if __name__ ==
"__main__"`` guard. A script that starts such a pool itself (builds a dataset's cache directly, say)
needs that guard, as with any multiprocessing.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor


def process_pool(workers: int, *, preload: str | None = None, initializer: Callable[..., None] | None = None,
                 initargs: tuple = ()) -> ProcessPoolExecutor:
    """A process pool on a fork server (spawn where there is none); ``preload`` imports a module once."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver" and preload:
        ctx.set_forkserver_preload([preload])
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=initializer, initargs=initargs)
