"""`PlanRequest`: what `plan()` was asked for, checked once and turned into
the search's `PlannerOptions`.

`plan()`'s keyword arguments are the public form; the planner's own path
(`planner.plan_with_cost`) takes this one object instead of repeating them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from keras_autoshard.errors import PlanError
from keras_autoshard.planner.cost_model import PlannerOptions
from keras_autoshard.planner.lever_options import sequence_parallel_modes
from keras_autoshard.planner.memory_model import JOBS
from keras_autoshard.plans.hardware import HardwareProfile, hardware_profile
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.units import optional_byte_size
from keras_autoshard.runtime.devices import accelerator_memory_budget


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What a plan was asked for, apart from the model, mesh and sample.

    Args:
        memory_budget: Per-device bytes (a number or a string such as
            `"16GiB"`), or `None` for the hardware's or accelerators' own.
        rules: Regular expression on variable path → spec, pinned as given.
        device_count: Devices to plan for when no mesh is given.
        optimizer_slots: Optimizer state per parameter in parameter copies.
        progress: Show a progress bar on stderr.
        hardware: A hardware profile name or `HardwareProfile`.
        job: `"train"`, `"inference"` or `"generate"`.
        rematerialize: `"auto"`, `"none"`, `"all"` or layer names.
        sequence_parallel: `False`, `True` or `"auto"`.
        gradient_accumulation_steps: `None` (chosen to fit) or a count.
        batch_over_model_axes: Whether a model axis may cut the batch where
            no data axis does.

    `plan()` documents each at its argument of the same name.

    Example:
        `plan_with_cost(build, mesh, sample, PlanRequest(hardware="h100-80gb"))`
    """

    memory_budget: int | str | None = None
    rules: Mapping[str, Spec] | None = None
    device_count: int | None = None
    optimizer_slots: int = 2
    progress: bool = False
    hardware: str | HardwareProfile | None = None
    job: str = "train"
    rematerialize: str | Sequence[str] = "auto"
    sequence_parallel: bool | str = False
    gradient_accumulation_steps: int | None = None
    batch_over_model_axes: bool = True

    def check(self) -> None:
        """Raise on a request no plan can answer, before any tracing.

        Raises:
            ValueError: For an unknown `job` or `sequence_parallel`.
            PlanError: For a micro-batch count below 1.
        """
        if self.job not in JOBS:
            raise ValueError(f"job={self.job!r}: use one of {JOBS}.")
        sequence_parallel_modes(self.sequence_parallel, self.job)
        steps = self.gradient_accumulation_steps
        if steps is not None and steps < 1:
            raise PlanError(
                f"gradient_accumulation_steps={steps}: use None "
                "(chosen to fit), 1 (never) or a count of micro-batches."
            )

    def profile(self) -> HardwareProfile | None:
        """The hardware profile asked for, if any (`plans.hardware`)."""
        return hardware_profile(self.hardware) if self.hardware is not None else None

    @property
    def budget_asked(self) -> bool:
        """Whether the user set the budget (a plan that cannot fit it is an
        error; one over a default budget only a warning)."""
        return self.memory_budget is not None

    def budget_bytes(self, profile: HardwareProfile | None) -> int | None:
        """The per-device budget: the one asked for, else the profile's
        usable memory, else the accelerators' own (`None` on CPU)."""
        asked = optional_byte_size(self.memory_budget)
        if asked is not None:
            return asked
        if profile is not None:
            return profile.memory_budget_bytes
        return accelerator_memory_budget()

    def planner_options(
        self,
        memory_budget_bytes: int | None,
        platform: str,
        profile: HardwareProfile | None,
    ) -> PlannerOptions:
        """The search's options for this request on `platform`."""
        return PlannerOptions(
            memory_budget_bytes=memory_budget_bytes,
            optimizer_slots=self.optimizer_slots,
            platform=platform,
            hardware=profile,
            job=self.job,
            rematerialize=_remat_request(self.rematerialize),
            sequence_parallel=self.sequence_parallel,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            batch_over_model_axes=self.batch_over_model_axes,
        )


def _remat_request(rematerialize: str | Sequence[str]) -> str | tuple[str, ...]:
    return rematerialize if isinstance(rematerialize, str) else tuple(rematerialize)
