"""The parallel executor of sweeps and plans: one function, many jobs, rows back.

`Executor` runs a module-level function (picklable by reference: a sweep's
`run_point`) on each job in this process, in a local pool of spawned processes, or on
Ray, and hands each job's row to `done(index, row)` as it finishes, in any order. A job
whose worker died is a row with status "error" and the reason, never an exception. It
is a context manager that keeps its workers between calls to `run`: a spawned worker
takes seconds to import the simulator, and a plan's search runs many small batches.

Ray: "local" starts a private instance on this machine; any other address joins a
cluster (`ray_init`). A Ray that is already initialised is used as it is and left
running; one started here is shut down on exit.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

__all__ = [
    "RAY_REQUIREMENT",
    "STATUS_ERROR",
    "Executor",
    "ExploreError",
    "error_row",
    "ray_init",
    "require_ray",
]

# What to install for `--ray` (the CLI's message and the docs say the same).
RAY_REQUIREMENT = "ray==2.60.0"
STATUS_ERROR = "error"  # a job's row when it raised or its worker died

Row = dict[str, Any]
Job = tuple[int, tuple[Any, ...]]  # (index, the function's arguments)


class ExploreError(ValueError):
    """Bad input to a sweep or a plan (theirs: SweepError, PlanError; --ray here): one
    message for a human, no traceback (the CLI exits 2)."""


def _project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def require_ray() -> None:
    """ExploreError (install hint) if Ray cannot be imported."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ExploreError(
            f"--ray needs Ray, which is not installed here: pip install '{RAY_REQUIREMENT}'"
        ) from None


def ray_init(address: str, workers: int | None = None) -> bool:
    """Start or join Ray; False if it was already initialised (then leave it running).

    "local" starts a private instance on this machine with `workers` CPUs; anything
    else is a cluster address (host:port, "auto", ray://host:10001) joined with the
    project's code shipped as the job's working directory, so the workers run this
    version of kvstage (their Python environment must have its dependencies).
    """
    require_ray()
    import ray

    if ray.is_initialized():
        return False
    # Usage statistics would be reported over the network; a sweep has no business doing so.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if address == "local":
            ray.init(
                address="local",  # a new private instance, even if a cluster runs here
                num_cpus=workers or os.cpu_count() or 1,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
                object_store_memory=128 << 20,  # results are a few KiB per point
            )
        else:
            root = _project_root()
            ray.init(
                address=address,
                log_to_driver=False,
                runtime_env={
                    "working_dir": str(root),
                    "excludes": [
                        ".venv/",
                        ".git/",
                        "runs/",
                        "sweeps/",
                        "tests/",
                        "benchmarks/",
                        "__pycache__/",
                        "*.parquet",
                        "*.jsonl",
                        "*.png",
                    ],
                },
            )
    except Exception as exc:
        hint = ""
        if address != "local" and "RAY_AUTH_MODE" not in os.environ:
            hint = (
                " (a cluster started with token authentication, the default of `ray start`,"
                " needs RAY_AUTH_MODE=token here and its token in ~/.ray/auth_token or"
                " RAY_AUTH_TOKEN)"
            )
        raise ExploreError(
            f"--ray {address}: cannot start or join Ray: {type(exc).__name__}: {exc}{hint}"
        ) from None
    return True


class Executor:
    """Where jobs run: Ray when `ray_address` is given, else a local pool of spawned
    processes (`workers`, default os.cpu_count(); at most `jobs` of them when the number
    of jobs is known), else, with one worker (or one job), this process."""

    def __init__(
        self, workers: int | None, ray_address: str | None = None, jobs: int | None = None
    ) -> None:
        self.workers, self.ray_address = workers, ray_address
        self.nworkers = workers or os.cpu_count() or 1
        self.size = self.nworkers if jobs is None else min(self.nworkers, jobs)
        self.pool: ProcessPoolExecutor | None = None
        self.started = False  # Ray started here (shut down on exit)
        if ray_address is not None:
            self.backend = f"Ray ({ray_address})"
        elif self.size > 1:
            self.backend = f"{self.size} local processes"
        else:
            self.backend = "this process"

    def __enter__(self) -> Executor:
        if self.ray_address is not None:
            self.started = ray_init(self.ray_address, self.workers)
        elif self.size > 1:
            ctx = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(self.size, mp_context=ctx)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        if self.started:
            import ray

            ray.shutdown()

    def run(
        self, fn: Callable[..., Row], jobs: Sequence[Job], done: Callable[[int, Row], None]
    ) -> None:
        """fn(*args) for every (index, args) of `jobs`; done(index, row) as each finishes."""
        if self.ray_address is not None:
            self._run_ray(fn, jobs, done)
        elif self.pool is None:
            for index, args in jobs:
                done(index, fn(*args))
        else:
            futures = {self.pool.submit(fn, *args): index for index, args in jobs}
            for fut in as_completed(futures):
                try:
                    row = fut.result()
                except Exception as exc:  # the worker process died (e.g. out of memory)
                    row = _failed(f"worker failed: {type(exc).__name__}: {exc}")
                done(futures[fut], row)

    def _run_ray(
        self, fn: Callable[..., Row], jobs: Sequence[Job], done: Callable[[int, Row], None]
    ) -> None:
        import ray

        task = ray.remote(num_cpus=1, max_retries=0)(fn)
        refs = {task.remote(*args): index for index, args in jobs}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    row = ray.get(ref)
                except Exception as exc:  # the task or its worker died
                    row = _failed(f"Ray task failed: {type(exc).__name__}: {exc}")
                done(refs[ref], row)


def _failed(reason: str) -> Row:
    return {"status": STATUS_ERROR, "reason": reason}


def error_row(exc: BaseException) -> Row:
    """A job's row when its function raised (a simulator bug): the exception and where."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return _failed(f"{type(exc).__name__}: {exc}{where}")
