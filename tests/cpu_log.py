"""CPU seconds per test, for the suite's time budget (user + sys of the
whole run, not wall time: `pytest --durations` shows wall time, which the
two workers and the machine's other load blur).

With `KERAS_AUTOSHARD_CPU_LOG=FILE`, `tests/conftest.py` appends one line
per test to FILE: its node id, CPU seconds of the worker process, CPU
seconds of the subprocesses it waited for (torchrun ranks, CLI runs), wall
seconds, and of the worker's seconds those XLA spent compiling, with the
number of compiled programs the persistent cache served and the number it
compiled. A module's fixtures count in its first test. Summarised per file:

    KERAS_AUTOSHARD_CPU_LOG=/tmp/cpu.tsv bash dev.sh test
    .venv/bin/python -m tests.cpu_log /tmp/cpu.tsv
"""

from __future__ import annotations

import collections
import resource
import sys
import time

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"


class CpuLog:
    """Counters of this process, read before and after each test."""

    def __init__(self, path: str):
        from jax._src import monitoring  # the events JAX records

        self.path = path
        self.compile_seconds = 0.0
        self.cache_hits = 0
        self.cache_misses = 0
        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)

    def _duration(self, event: str, duration: float, **_) -> None:
        if event == _COMPILE_EVENT:
            self.compile_seconds += duration

    def _event(self, event: str, **_) -> None:
        if event == _CACHE_HIT_EVENT:
            self.cache_hits += 1
        elif event == _CACHE_MISS_EVENT:
            self.cache_misses += 1

    def counters(self) -> tuple[float, ...]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (
            own.ru_utime + own.ru_stime,
            children.ru_utime + children.ru_stime,
            time.monotonic(),
            self.compile_seconds,
            self.cache_hits,
            self.cache_misses,
        )

    def write(self, node_id: str, before: tuple, after: tuple) -> None:
        own, children, wall, compiling, hits, misses = (
            b - a for a, b in zip(before, after)
        )
        with open(self.path, "a") as file:
            file.write(
                f"{node_id}\t{own:.2f}\t{children:.2f}\t{wall:.2f}\t"
                f"{compiling:.2f}\t{hits}\t{misses}\n"
            )


def per_file(path: str) -> list[tuple[str, float, float, float, int]]:
    """(file, CPU seconds with subprocesses, of them compiling, worker CPU,
    tests), the costliest first."""
    totals: dict = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    with open(path) as file:
        for line in file:
            node_id, own, children, _, compiling, _, _ = line.rstrip("\n").split("\t")
            row = totals[node_id.split("::")[0]]
            row[0] += float(own) + float(children)
            row[1] += float(compiling)
            row[2] += float(own)
            row[3] += 1
    return sorted(((name, *row) for name, row in totals.items()), key=lambda r: -r[1])


if __name__ == "__main__":
    rows = per_file(sys.argv[1])
    print(f"{'CPU s':>8} {'compile':>8} {'worker':>8} {'tests':>5}  file")
    for name, cpu, compiling, own, count in rows:
        print(f"{cpu:8.1f} {compiling:8.1f} {own:8.1f} {count:5d}  {name}")
    print(
        f"{sum(r[1] for r in rows):8.1f} {sum(r[2] for r in rows):8.1f}"
        f" {sum(r[3] for r in rows):8.1f} {sum(r[4] for r in rows):5d}  all"
    )
