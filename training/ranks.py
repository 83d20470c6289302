"""Which process is an MPI rank, read from what its launcher put in its environment (or, where that cannot be
read, from its command line).

Kept free of torch and Horovod: the pods' entry points (``training.mpi_entry``) import it as PID 1, where
start-up time matters (sshd must listen at once).
"""

from __future__ import annotations

from collections.abc import Mapping

#: Where a launcher puts a process's rank before Horovod starts: horovodrun's Gloo path sets HOROVOD_RANK
#: (horovod ``runner/gloo_run.py``); mpirun sets OMPI_COMM_WORLD_RANK and PMIx's PMIX_RANK, never HOROVOD_RANK
#: (OpenMPI 4.1 ``mpirun(1)``, "Exported Environment Variables").
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def launcher_rank(env: Mapping[str, str]) -> str:
    """This process's rank as its launcher named it ("0" for a plain run): the log's rank label."""
    return next((env[name] for name in RANK_VARIABLES if env.get(name)), "0")


def is_rank(env: Mapping[str, str]) -> bool:
    """A launcher started this process as a rank (or it descends from one: a data-loader worker)."""
    return any(env.get(name) for name in RANK_VARIABLES)


#: The trainer's module, as every launcher starts a rank: ``python -m training.train ...``.
TRAINER_MODULE = "training.train"


def is_trainer_command(argv: list[str]) -> bool:
    """Whether a command line runs the trainer (``-m training.train`` as two of its arguments): how a rank is told
    where its environment cannot be read. A shell whose one ``-c`` string holds that command is no rank; the
    trainer it starts is."""
    return any(argv[index:index + 2] == ["-m", TRAINER_MODULE] for index in range(len(argv) - 1))


#: Set in a worker that a warm spare became (``training.warm``; the elastic trainer reports it when the worker
#: joins). Here, not in ``training.warm``, so the trainer never imports the spares' keeper that starts it.
STARTED_WARM_ENV = "LANEFLOW_STARTED_WARM"
