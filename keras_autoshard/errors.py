"""Every error the library raises, under one base, `AutoShardError`.

Each class keeps the built-in base callers caught before (`ValueError`,
`RuntimeError`) as a second base, so `except ValueError` still works. Messages
name the value that was wrong (variable, dim, size, file) and what to do.

Example:

```python
import keras_autoshard as ka
from keras_autoshard.errors import PlanError

try:
    sharding_plan = ka.plan(build_model, mesh, sample_input, memory_budget="1GB")
except PlanError as error:
    print(error)  # names the least peak found and what to change
```
"""

from __future__ import annotations

__all__ = [
    "AutoShardError",
    "PlanError",
    "BatchSizeError",
    "ModelNotTraceableError",
    "InfeasibleError",
    "SolverTimeLimitError",
    "DimSizeMismatchError",
    "TensorParallelError",
    "TensorFlowModelParallelError",
    "CollectiveError",
    "CheckpointError",
    "DeviceSetupError",
    "GpuCompilerMissingError",
    "ClusterError",
    "TorchSetupError",
    "ModelSourceError",
    "HloParseError",
]


class AutoShardError(Exception):
    """Base of every keras-autoshard error: `except AutoShardError` catches all."""


class PlanError(AutoShardError, ValueError):
    """A plan that cannot be made or applied as written."""


class InfeasibleError(AutoShardError, RuntimeError):
    """A linear program with no solution (for a plan: nothing fits the budget)."""


class SolverTimeLimitError(PlanError):
    """The exact solver ran out of time before it found any plan.

    Not a proof that nothing fits: the same program solves with more time
    (a loaded machine slows the solver's wall clock).
    """


class DimSizeMismatchError(AutoShardError, ValueError):
    """Two dimensions of different sizes were asked to be one axis."""


class TensorParallelError(AutoShardError, ValueError):
    """`TensorParallel` cannot do what was asked."""


class TensorFlowModelParallelError(TensorParallelError, PlanError):
    """Tensor (model) parallelism was asked for under the TensorFlow backend."""


class CollectiveError(AutoShardError):
    """A collective that cannot run as asked.

    A collective never falls back to returning its input unchanged.
    """


class CheckpointError(AutoShardError, ValueError):
    """A checkpoint that cannot be loaded or saved as asked.

    The message names the file and the variable concerned. Nothing is
    assigned to a model when a load raises this before assignment.
    """


class DeviceSetupError(AutoShardError, RuntimeError):
    """Simulated devices can no longer be configured as asked."""


class GpuCompilerMissingError(DeviceSetupError):
    """Compiling for a GPU target needs JAX's CUDA plugin, which is missing."""


class ClusterError(AutoShardError, RuntimeError):
    """The multi-process set-up is incomplete or contradicts itself."""


class TorchSetupError(AutoShardError, RuntimeError):
    """The PyTorch distributed set-up cannot run the request."""


class ModelSourceError(AutoShardError, ValueError):
    """A model source (command line) that cannot be loaded."""


class BenchmarkSetupError(AutoShardError, RuntimeError):
    """The benchmarks cannot be run from here (not a source checkout)."""


class HloParseError(AutoShardError, ValueError):
    """Optimized HLO text that cannot be read as expected."""


class BatchSizeError(PlanError):
    """A batch that the data axis cannot split evenly."""


class ModelNotTraceableError(PlanError):
    """A model whose forward pass `jax.jit` cannot trace (so no plan and no
    sharded step can be made from it); the message names the layer and the
    source line where tracing stopped."""
