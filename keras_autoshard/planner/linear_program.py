"""A small mixed-integer linear program builder solved with SciPy's HiGHS."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from scipy import optimize, sparse

from keras_autoshard.errors import InfeasibleError, SolverTimeLimitError

logger = logging.getLogger(__name__)

# A solve stopped by its time limit with no solution is run again with this
# many times the limit, up to this many times; then `SolverTimeLimitError`.
TIME_LIMIT_GROWTH = 2
TIME_LIMIT_RETRIES = 2


@dataclasses.dataclass(frozen=True)
class SolveOutcome:
    """How the solver ended one program.

    Args:
        status: `"optimal"` (proved within the relative gap the solver is
            given, 1e-6), `"node limit"` or `"time limit"` (stopped early:
            the best solution found is used).
        gap: HiGHS's relative optimality gap of that solution, `|objective
            - dual bound| / |objective|` (0 when proved optimal; `None`
            where the solver gives none).
        nodes: Branch-and-bound nodes explored.
    """

    status: str
    gap: float | None = None
    nodes: int | None = None

    def describe(self) -> str:
        """In words, e.g. "optimal (23 nodes)"."""
        gap = "" if self.gap is None else f", optimality gap {self.gap:.2%}"
        nodes = "" if self.nodes is None else f", {self.nodes} nodes"
        if self.status == "optimal":
            return f"optimal{nodes}"
        return f"stopped at the {self.status}: best plan found{gap}{nodes}"


def _stopped_by_time(result) -> bool:
    """Whether HiGHS stopped at its wall-clock limit."""
    return "time limit" in str(result.message).lower()


def _outcome(result) -> SolveOutcome:
    gap = getattr(result, "mip_gap", None)
    nodes = getattr(result, "mip_node_count", None)
    if result.status == 0:
        status = "optimal"
    else:
        # HiGHS ends a search stopped by its node limit with "Solution limit
        # reached" (status 16, which SciPy does not name).
        status = "time limit" if _stopped_by_time(result) else "node limit"
    return SolveOutcome(
        status=status,
        gap=None if gap is None or not np.isfinite(gap) else float(gap),
        nodes=None if nodes is None else int(nodes),
    )


@dataclasses.dataclass
class LinearProgram:
    """Variables with bounds and costs, and linear rows `lb <= a.x <= ub`.

    Example:

    ```python
    lp = LinearProgram()
    x = lp.add_var(cost=-1.0, integer=True)
    y = lp.add_var(cost=-1.0, integer=True)
    lp.add_row({x: 1.0, y: 1.0}, upper=1.0)
    values = lp.solve()
    assert values[x] + values[y] == 1
    ```
    """

    costs: list[float] = dataclasses.field(default_factory=list)
    lower: list[float] = dataclasses.field(default_factory=list)
    upper: list[float] = dataclasses.field(default_factory=list)
    integer: list[bool] = dataclasses.field(default_factory=list)
    rows: list[dict[int, float]] = dataclasses.field(default_factory=list)
    row_lower: list[float] = dataclasses.field(default_factory=list)
    row_upper: list[float] = dataclasses.field(default_factory=list)
    # How the last `solve` ended.
    outcome: SolveOutcome | None = None

    @property
    def num_vars(self) -> int:
        return len(self.costs)

    def add_var(
        self,
        cost: float = 0.0,
        lower: float = 0.0,
        upper: float = 1.0,
        integer: bool = False,
    ) -> int:
        self.costs.append(float(cost))
        self.lower.append(float(lower))
        self.upper.append(float(upper))
        self.integer.append(bool(integer))
        return len(self.costs) - 1

    def add_cost(self, var: int, cost: float) -> None:
        self.costs[var] += float(cost)

    def add_row(
        self,
        coefficients: dict[int, float],
        lower: float = -np.inf,
        upper: float = np.inf,
    ) -> None:
        if not coefficients:
            if lower > 0 or upper < 0:
                raise InfeasibleError("An empty constraint row cannot hold.")
            return
        self.rows.append(dict(coefficients))
        self.row_lower.append(float(lower))
        self.row_upper.append(float(upper))

    def solve(
        self, time_limit_s: float = 60.0, node_limit: int | None = None
    ) -> np.ndarray:
        """Solve; returns the variable values (integers rounded). How the
        solver ended is left in `outcome`.

        Args:
            time_limit_s: Wall-clock limit of the solver.
            node_limit: Branch-and-bound nodes the solver may explore
                (deterministic, unlike the time limit); `None` for no limit.
                Reached with no integer solution, the program counts as
                infeasible (`InfeasibleError`). The time limit reached with
                no solution does not: the solve runs again with
                `TIME_LIMIT_GROWTH` times the limit, at most
                `TIME_LIMIT_RETRIES` times, then raises
                `SolverTimeLimitError`.
        """
        if self.num_vars == 0:
            self.outcome = SolveOutcome("optimal", 0.0, 0)
            return np.zeros(0)
        data, row_index, col_index = [], [], []
        for r, row in enumerate(self.rows):
            for col, value in row.items():
                row_index.append(r)
                col_index.append(col)
                data.append(value)
        constraints = []
        if self.rows:
            matrix = sparse.csr_array(
                (data, (row_index, col_index)), shape=(len(self.rows), self.num_vars)
            )
            constraints.append(
                optimize.LinearConstraint(matrix, self.row_lower, self.row_upper)
            )
        limit = time_limit_s
        while True:
            result = optimize.milp(
                c=np.asarray(self.costs),
                integrality=np.asarray(self.integer, dtype=int),
                bounds=optimize.Bounds(self.lower, self.upper),
                constraints=constraints,
                options={
                    "time_limit": limit,
                    "mip_rel_gap": 1e-6,
                    **({} if node_limit is None else {"node_limit": node_limit}),
                },
            )
            if result.x is not None or not _stopped_by_time(result):
                break
            # Out of time with no solution proves nothing about feasibility
            # (the same program solves in time on a less loaded machine):
            # retry with a longer limit before saying so.
            if limit >= time_limit_s * TIME_LIMIT_GROWTH**TIME_LIMIT_RETRIES:
                raise SolverTimeLimitError(
                    f"The exact solver found no plan within {limit:.3g} s "
                    f"(a program of {self.num_vars} variables and "
                    f"{len(self.rows)} constraints): it ran out of time, "
                    "which does not show that nothing fits. Plan on a less "
                    "loaded machine, or with fewer meshes or levers."
                )
            logger.info(
                "MILP stopped at its %.0f s time limit with no solution; "
                "solving again with %.0f s.",
                limit,
                limit * TIME_LIMIT_GROWTH,
            )
            limit *= TIME_LIMIT_GROWTH
        if result.x is None:
            raise InfeasibleError(f"No solution: {result.message}")
        self.outcome = _outcome(result)
        if result.status != 0:
            logger.warning(
                "MILP stopped early (%s); using best plan found.", result.message
            )
        values = np.asarray(result.x)
        integer_mask = np.asarray(self.integer)
        values[integer_mask] = np.round(values[integer_mask])
        return values
