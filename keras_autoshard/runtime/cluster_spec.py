"""`ClusterSpec`: where this process sits in a multi-process job (plain data)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a multi-process job.

    Attributes:
        coordinator_address: `host:port` of process 0's coordination service
            (`None` for a single process).
        num_processes: Processes in the job.
        process_id: This process, `0 <= process_id < num_processes`.
        source: Where the values came from (`"arguments"`, `"keras"`,
            `"jax"`, `"torchrun"`, `"slurm"` or `"single process"`).

    Example:

    ```python
    spec = resolve_cluster("10.0.0.1:1234", num_processes=2, process_id=1)
    spec.is_multi_process  # True
    spec.describe()  # 'process 1 of 2, coordinator 10.0.0.1:1234 (from arguments)'
    ```
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int
    source: str

    @property
    def is_multi_process(self) -> bool:
        """Whether the job has more than one process."""
        return self.num_processes > 1

    def describe(self) -> str:
        """This process's place in the job, as one line of text."""
        if not self.is_multi_process:
            return "single process"
        return (
            f"process {self.process_id} of {self.num_processes}, coordinator "
            f"{self.coordinator_address} (from {self.source})"
        )
