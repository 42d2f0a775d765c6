"""Run test workers in separate OS processes (spawn) and always reap them."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable, Sequence
from typing import Any

CTX = mp.get_context("spawn")


def _trampoline(fn: Callable[..., Any], args: tuple[Any, ...], results: Any, index: int) -> None:
    try:
        results.put((index, "ok", fn(*args)))
    except BaseException:  # report every failure, including SystemExit, to the parent
        results.put((index, "error", traceback.format_exc()))


class ProcessGroup:
    """Start workers, collect their return values, kill whatever is left on exit."""

    def __init__(self) -> None:
        self.manager_queue = CTX.Queue()
        self._processes: list[mp.process.BaseProcess] = []

    def queue(self) -> Any:
        return CTX.Queue()

    def start(self, fn: Callable[..., Any], *args: Any) -> int:
        index = len(self._processes)
        process = CTX.Process(target=_trampoline, args=(fn, args, self.manager_queue, index))
        process.start()
        self._processes.append(process)
        return index

    def results(self, timeout_s: float = 120.0) -> list[Any]:
        """Every worker's return value, in start order; raises on the first failure."""
        pending = len(self._processes)
        values: dict[int, Any] = {}
        while pending:
            try:
                index, status, value = self.manager_queue.get(timeout=timeout_s)
            except queue.Empty as error:
                raise TimeoutError(f"{pending} worker(s) did not finish in {timeout_s}s") from error
            if status == "error":
                raise AssertionError(f"worker {index} failed:\n{value}")
            values[index] = value
            pending -= 1
        return [values[i] for i in range(len(self._processes))]

    def results_of(self, index: int, timeout_s: float = 120.0) -> Any:
        """One worker's return value, when others may die without reporting."""
        deadline = timeout_s
        while True:
            try:
                got, status, value = self.manager_queue.get(timeout=deadline)
            except queue.Empty as error:
                raise TimeoutError(f"worker {index} did not finish in {timeout_s}s") from error
            if got != index:
                continue
            if status == "error":
                raise AssertionError(f"worker {index} failed:\n{value}")
            return value

    def kill(self, index: int) -> None:
        self._processes[index].kill()
        self._processes[index].join()

    def close(self) -> None:
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_all(
    calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]], timeout_s: float = 120.0
) -> list[Any]:
    with ProcessGroup() as group:
        for fn, args in calls:
            group.start(fn, *args)
        return group.results(timeout_s)
