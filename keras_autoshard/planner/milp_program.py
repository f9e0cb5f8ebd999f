"""`MilpProgram`: the mixed-integer program behind `search.search`, as
variables, constraints and an objective that its builders extend.

Binary `x[c, a]` shards axis class `c` on mesh axis `a`; binary
`y[p, a][d]` adds FSDP storage sharding of parameter `p` over `a` along dim
`d`. A tensor's per-device bytes depend on which mesh axes shard it, a
product over axes; it is linearised with one-hot "pattern" variables over
the subsets of mesh axes (meshes have few axes, `pattern`), and costs that
need "event fires on axis a AND tensor is cut by S" use the standard AND
linearisation (`add_conditional_bytes`). The builders are
`milp_builder.py` (the sharding's variables, rules and costs) and
`peak_budget.py` (the memory budget).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

from keras_autoshard.graph.axis_graph import AxisGraph, TensorNode
from keras_autoshard.planner.cost_model import Assignment, PlannerOptions
from keras_autoshard.planner.linear_program import LinearProgram
from keras_autoshard.planner.mesh_axis import MeshAxis, covering
from keras_autoshard.planner.pins import Pins

# A variable of the linear program (its column).
Var = int
# Variable → coefficient of a row or cost.
Terms = dict[int, float]
# Subset of mesh axes cutting a tensor → its one-hot variable.
Pattern = dict[frozenset[str], int]

# Branch-and-bound nodes a budgeted search may explore: a budget can leave a
# feasible relaxation with no integer solution (a lever that cannot fit),
# which the solver may spend its whole time limit failing to prove; past
# this many nodes it keeps its best plan found and logs "MILP stopped early".
BUDGET_NODE_LIMIT = 50
# Share of the least replicated compute a compute-first solve may give up
# (the solver's own tolerance).
_COMPUTE_SLACK = 1e-6


class MilpProgram:
    """The program for one graph and mesh: its variables, rows and costs.

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1 (`cost_model.planning_axes`).
        options: The search's budget and cost knobs.
        pins: Choices fixed by user rules.
        batch_split: `"forced"` (every data axis cuts the inputs' batch),
            `"preferred"` (rewarded above every other cost) or `"free"`.

    Attributes:
        lp: The linear program (`linear_program.LinearProgram`).
        x: `(class id, axis name)` → its binary variable.
        y: `(parameter name, axis name)` → `{dim: binary variable}`.
        batch_vars: Variables that cut an input's batch over a data axis.
        compute_splits: Replicated-math penalty variables → the penalty
            each avoids.

    Example:

    ```python
    program = MilpProgram(graph, planning_axes(mesh), PlannerOptions(), Pins())
    milp_builder.add_class_vars(program)
    assignment = program.solve()
    ```
    """

    def __init__(
        self,
        graph: AxisGraph,
        axes: tuple[MeshAxis, ...],
        options: PlannerOptions,
        pins: Pins,
        batch_split: str = "forced",
    ):
        self.graph = graph
        self.batch_split = batch_split
        self.batch_vars: list[Var] = []
        self.axes = axes
        self.sizes: dict[str, int] = {a.name: a.size for a in axes}
        self.options = options
        self.pins = pins
        self.lp = LinearProgram()
        self.x: dict[tuple[int, str], Var] = {}
        self.y: dict[tuple[str, str], dict[int, Var]] = {}
        self._patterns: dict[tuple, Pattern | None] = {}
        self.compute_splits: dict[Var, float] = {}

    def shard_count_terms(self, tensor: TensorNode, axis: str, fsdp: bool) -> Terms:
        """`{var: 1}` for each way `tensor` is cut over mesh axis `axis`: its
        classes, and with `fsdp` its storage cuts."""
        terms = {
            self.x[(c, axis)]: 1.0
            for c in set(tensor.dim_classes) - {None}
            if (c, axis) in self.x
        }
        if fsdp and tensor.kind == "param":
            for var in self.y.get((tensor.name, axis), {}).values():
                terms[var] = 1.0
        return terms

    def pattern(self, tensor: TensorNode, fsdp: bool) -> Pattern | None:
        """One-hot over subsets of mesh axes cutting `tensor`; None if constant."""
        classes = frozenset(c for c in tensor.dim_classes if c is not None)
        name = tensor.name if (fsdp and tensor.kind == "param") else None
        key = (classes, name)
        if key in self._patterns:
            return self._patterns[key]
        counts = {
            a.name: self.shard_count_terms(tensor, a.name, fsdp) for a in self.axes
        }
        free_axes = [a for a in self.sizes if counts[a]]
        if not free_axes:
            self._patterns[key] = None
            return None
        pattern: Pattern = {}
        for r in range(len(free_axes) + 1):
            for subset in itertools.combinations(free_axes, r):
                pattern[frozenset(subset)] = self.lp.add_var()
        self.lp.add_row({v: 1.0 for v in pattern.values()}, lower=1.0, upper=1.0)
        for axis in free_axes:
            row = {v: 1.0 for s, v in pattern.items() if axis in s}
            for var, coefficient in counts[axis].items():
                row[var] = row.get(var, 0.0) - coefficient
            self.lp.add_row(row, lower=0.0, upper=0.0)
        self._patterns[key] = pattern
        return pattern

    def bytes_terms(
        self, tensor: TensorNode, fsdp: bool, scale: float = 1.0
    ) -> tuple[float, Terms]:
        """(constant, {var: coefficient}) of the tensor's per-device bytes."""
        pattern = self.pattern(tensor, fsdp)
        if pattern is None:
            return scale * tensor.nbytes, {}
        return 0.0, {
            v: scale * tensor.nbytes / math.prod(self.sizes[a] for a in s)
            for s, v in pattern.items()
        }

    def is_pinned(self, tensor: TensorNode) -> bool:
        """Whether a user rule fixes a class of `tensor`."""
        return any(c in self.pins.class_axis for c in tensor.dim_classes)

    def add_conditional_bytes(
        self, trigger: Var, tensor: TensorNode, weight: float
    ) -> None:
        """Cost weight × tensor bytes when `trigger` is 1 (AND-linearised)."""
        pattern = self.pattern(tensor, fsdp=False)
        if pattern is None:
            self.lp.add_cost(trigger, weight * tensor.nbytes)
            return
        for subset, z in pattern.items():
            coefficient = (
                weight * tensor.nbytes / math.prod(self.sizes[a] for a in subset)
            )
            both = self.lp.add_var(cost=coefficient)
            self.lp.add_row({both: 1.0, trigger: -1.0, z: -1.0}, lower=-1.0)

    def cuts_over(self, classes: Iterable[int], axis_name: str) -> Terms:
        """`{x: 1}` for each way one of `classes` is cut over mesh axis
        `axis_name`, by itself or within an axis spanning it."""
        return {
            self.x[(c, used.name)]: 1.0
            for c in classes
            for used in covering(self.axes, axis_name)
            if (c, used.name) in self.x
        }

    def add_equal(self, a: Var | None, b: Var | None) -> None:
        """Binary variables `a` and `b` (None: fixed at 0) take one value."""
        if a is None and b is None:
            return
        if a is None or b is None:
            self.lp.add_row({a if b is None else b: 1.0}, upper=0.0)
            return
        self.lp.add_row({a: 1.0, b: -1.0}, lower=0.0, upper=0.0)

    def _hold_least_replicated_math(self, limits: dict) -> None:
        """Solve for the least compute repeated on several devices alone
        (the budget still holding), then keep every later solve to it: the
        costs then choose only among plans that leave no more devices idle."""
        costs = self.lp.costs
        self.lp.costs = [0.0] * len(costs)
        for var, penalty in self.compute_splits.items():
            self.lp.costs[var] = -penalty
        try:
            values = self.lp.solve(**limits)
        finally:
            self.lp.costs = costs
        avoided = sum(p * values[v] for v, p in self.compute_splits.items())
        self.lp.add_row(dict(self.compute_splits), lower=avoided * (1 - _COMPUTE_SLACK))

    def solve(self, compute_first: bool = False) -> Assignment:
        """Solve the program and read the sharding off its variables.

        Args:
            compute_first: Hold the least replicated compute first
                (`compute_splits`), then the other costs.

        Returns:
            The chosen classes' axes and storage cuts, with the solver's
            outcome.

        Raises:
            InfeasibleError: When no integer solution exists.
        """
        # Under a budget the program may have a feasible relaxation and no
        # integer solution (a lever that cannot fit); proving that can take
        # the solver long, so its search is bounded (`BUDGET_NODE_LIMIT`).
        budgeted = self.options.memory_budget_bytes is not None
        limits = dict(
            time_limit_s=self.options.time_limit_s,
            node_limit=BUDGET_NODE_LIMIT if budgeted else None,
        )
        if compute_first and self.compute_splits:
            self._hold_least_replicated_math(limits)
        values = self.lp.solve(**limits)
        class_axis = {c: a for (c, a), var in self.x.items() if values[var] > 0.5}
        fsdp: dict[str, list[tuple[int, str]]] = {}
        for (name, axis), by_dim in self.y.items():
            for dim, var in by_dim.items():
                if values[var] > 0.5:
                    fsdp.setdefault(name, []).append((dim, axis))
        return Assignment(
            class_axis=class_axis,
            fsdp={k: tuple(v) for k, v in fsdp.items()},
            search=self.lp.outcome,
        )
