"""Load Keras, safetensors and KerasHub-preset weights into a sharded model.

Every variable keeps the sharding it was created with (under a
`PlanDistribution`, an `AutoShardDistribution` or none). For each variable,
each device's slice is read from the file as a hyperslab and placed on that
device (`jax.make_array_from_callback`), so the host holds at most one slice
at a time and never a whole array unless a device holds one whole. A
variable's old value is freed before its new slices are read, so no device
holds a variable twice either.

Names in files map to variables as follows:

- `.weights.h5`, `.keras` and Keras sharded weights (`.weights.json` index
  of several `.weights.h5` files): Keras's own layout, dataset
  `layers/<layer>/vars/<i>` (nested layers and attributes as Keras walks
  them), `optimizer/vars/<i>` for optimizer state; see `io/keras_weights_layout.py`.
- safetensors: a key is, in this order, translated by `name_map` when given,
  then matched against variable paths (`"dense/kernel"`, as
  `variable.path`), then against the `.weights.h5` dataset keys above, so a
  file written with either naming loads. Keys the map sends to `None` are
  skipped.
- KerasHub preset directory: `config.json` (the backbone, built from config
  under the distribution, no download) plus `model.weights.h5`, or
  `model.safetensors`, or several `*.safetensors` files.

Before anything is assigned, every model variable must be found with the same
shape and dtype, every tensor in the files must belong to the model, and
contiguous HDF5 datasets must lie within the file; otherwise a
`CheckpointError` names the file, the tensor, the variable and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping

from keras_autoshard.compat import keras_variables
from keras_autoshard.errors import CheckpointError
from keras_autoshard.io.keras_weights_layout import OPTIMIZER_GROUP, keras_h5_keys
from keras_autoshard.io.tensor_files import (
    H5TensorFile,
    SafetensorsTensorFile,
    SliceIndex,
    StoredTensor,
    TensorFile,
    check_compatible,
    numpy_dtype,
)
from keras_autoshard.progress import progress_bar

logger = logging.getLogger(__name__)

KERAS_WEIGHTS_FILE = "model.weights.h5"
PRESET_TASK_WEIGHTS_FILE = "task.weights.h5"
PRESET_CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"

# (file key, slice index, bytes read) for every slice read.
ReadObserver = Callable[[str, SliceIndex, int], None]
NameMap = Mapping[str, str | None] | Callable[[str], str | None]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a sharded load read.

    Args:
        files: The files read.
        variables_loaded: Number of variables assigned.
        bytes_read: Bytes read from the files, over all slices.
        max_read_bytes: Bytes of the largest single read (one device slice).
        seconds: Wall time of the load.
        skipped: File keys not loaded (optimizer state the model has no
            optimizer for, keys `name_map` sent to `None`).

    Example:

    ```python
    report = load_weights_sharded(model, "model.weights.h5")
    print(report.variables_loaded, report.max_read_bytes / 2**20, "MiB")
    ```
    """

    files: tuple[str, ...]
    variables_loaded: int
    bytes_read: int
    max_read_bytes: int
    seconds: float
    skipped: tuple[str, ...] = ()

    @property
    def gigabytes_per_second(self) -> float:
        """Read throughput: `bytes_read` in GB over `seconds`."""
        return self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else 0.0


def load_weights_sharded(
    model,
    path: str | os.PathLike,
    name_map: NameMap | None = None,
    on_read: ReadObserver | None = None,
    progress: bool = False,
) -> LoadReport:
    """Load weights into `model` device slice by device slice.

    Args:
        model: A built Keras model whose variables are already laid out (for
            example created under `PlanDistribution(plan).scope()`).
        path: A `.weights.h5`, `.keras`, `.safetensors` file, a Keras
            sharded-weights index (`.weights.json`), or a directory
            (KerasHub preset, or safetensors files).
        name_map: For safetensors: file key → variable path (or `None` to
            skip), as a dict or a function.
        on_read: Called after every slice read with (file key, index, bytes).
        progress: Show a progress bar on stderr, one step per variable.

    Returns:
        A `LoadReport`.

    Raises:
        CheckpointError: a missing, extra, mis-shaped or mis-typed tensor, or a
            damaged file; nothing is assigned when found before loading.

    Example:

    ```python
    with PlanDistribution(plan).scope():
        model = build_model()
    report = load_weights_sharded(model, "model.weights.h5")
    print(report.max_read_bytes, report.gigabytes_per_second)
    ```
    """
    start = time.perf_counter()
    model = weights_owner(model)
    with _opened_files(os.fspath(path)) as files:
        targets, skipped = _match_tensors(model, files, name_map)
        for tensor, variable in targets.values():
            check_compatible(tensor, variable)
            owner = _owner(files, tensor)
            if isinstance(owner, H5TensorFile):
                owner.check_within_file(tensor.key)
        bytes_read = 0
        max_read = 0
        bar = progress_bar(
            f"loading {os.path.basename(os.fspath(path))}",
            len(targets),
            enabled=progress,
        )
        with bar as task:
            for index_done, (tensor, variable) in enumerate(targets.values()):
                owner = _owner(files, tensor)

                def read(index, tensor=tensor, owner=owner):
                    nonlocal bytes_read, max_read
                    data = owner.read(tensor.key, index)
                    bytes_read += data.nbytes
                    max_read = max(max_read, data.nbytes)
                    if on_read is not None:
                        on_read(tensor.key, index, data.nbytes)
                    return data

                try:
                    _assign_from_slices(variable, tensor, read)
                except CheckpointError as error:
                    raise CheckpointError(
                        f"{error} The model is now partly loaded ({index_done} of "
                        f"{len(targets)} variables): load again from a good file."
                    ) from error
                task.advance()
        file_names = tuple(sorted({f.path for f in files}))
    return LoadReport(
        files=file_names,
        variables_loaded=len(targets),
        bytes_read=bytes_read,
        max_read_bytes=max_read,
        seconds=time.perf_counter() - start,
        skipped=tuple(skipped),
    )


def load_preset_sharded(
    preset_dir: str | os.PathLike,
    distribution=None,
    on_read: ReadObserver | None = None,
):
    """Build a KerasHub backbone from a preset's `config.json` and load it sharded.

    Args:
        preset_dir: A local preset directory (`config.json` and
            `model.weights.h5` or safetensors files); nothing is downloaded.
        distribution: The Keras distribution to create the model under
            (`PlanDistribution`, `AutoShardDistribution`); `None` uses the
            current one.
        on_read: As in `load_weights_sharded`.

    Returns:
        `(model, LoadReport)`.

    Example:

    ```python
    model, report = load_preset_sharded("gpt2_preset/", PlanDistribution(plan))
    ```
    """
    import keras

    config_path = os.path.join(os.fspath(preset_dir), PRESET_CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"Cannot read the preset config {config_path} ({error}). A KerasHub "
            "preset directory holds config.json next to its weights."
        ) from error
    scope = (
        distribution.scope() if distribution is not None else contextlib.nullcontext()
    )
    with scope:
        model = keras.saving.deserialize_keras_object(config)
    report = load_weights_sharded(model, preset_dir, on_read=on_read)
    return model, report


def from_preset(
    model_class,
    preset_dir: str | os.PathLike,
    distribution=None,
    on_read: ReadObserver | None = None,
    **kwargs,
):
    """`model_class.from_preset(preset_dir)`, with the backbone loaded sharded.

    Keras's own `from_preset` reads every weight whole into host memory before
    placing it. This builds the KerasHub task or backbone from the preset's
    configs under `distribution` (every variable created sharded, no weights
    read), then reads the backbone's weights slice by slice onto the devices
    (`load_weights_sharded`). A task's own head weights (`task.weights.h5`,
    small) are loaded by KerasHub as usual.

    Args:
        model_class: A KerasHub class with `from_preset` (a task such as
            `keras_hub.models.GemmaCausalLM`, or a backbone class).
        preset_dir: A local preset directory; nothing is downloaded.
        distribution: The Keras distribution to create the model under
            (`AutoShardDistribution`, `PlanDistribution`); `None` uses the
            current one.
        on_read: As in `load_weights_sharded`.
        **kwargs: Passed to `model_class.from_preset`.

    Returns:
        `(model, LoadReport)` for the backbone's weights.

    Example:

    ```python
    dist = keras_autoshard.AutoShardDistribution()
    model, report = keras_autoshard.from_preset(
        keras_hub.models.GemmaCausalLM, "gemma_preset/", dist
    )
    ```
    """
    from keras_autoshard.plans.identity import unique_variables
    from keras_autoshard.trace.tracer import abstract_variables

    scope = (
        distribution.scope() if distribution is not None else contextlib.nullcontext()
    )
    with scope:
        # The backbone's variables are created without values (none is
        # initialised whole), then read slice by slice.
        import keras_hub

        is_backbone = issubclass(model_class, keras_hub.models.Backbone)
        backbone_class = model_class if is_backbone else keras_hub.models.Backbone
        with abstract_variables():
            backbone = backbone_class.from_preset(
                os.fspath(preset_dir), load_weights=False, **kwargs
            )
        report = load_weights_sharded(backbone, preset_dir, on_read=on_read)
        for variable in unique_variables(backbone.variables):
            if not keras_variables.has_value(variable):  # not in the weights file
                keras_variables.initialize_deferred(variable)
        if is_backbone:
            return backbone, report
        # The task around it: its own (small) head weights the KerasHub way.
        model = model_class.from_preset(
            os.fspath(preset_dir), load_weights=False, backbone=backbone, **kwargs
        )
        task_weights = os.path.join(os.fspath(preset_dir), PRESET_TASK_WEIGHTS_FILE)
        if os.path.exists(task_weights):
            model.load_task_weights(task_weights)
    return model, report


# --------------------------------------------------------------------- files
@contextlib.contextmanager
def _opened_files(path: str) -> Iterator[list[TensorFile]]:
    if not os.path.exists(path):
        raise CheckpointError(f"No weights file or directory at {path}.")
    with contextlib.ExitStack() as stack:
        if os.path.isdir(path):
            names = _directory_weight_files(path)
        elif path.endswith(".keras"):
            names = [_extract_keras_weights(path, stack)]
        elif path.endswith(".json"):
            names = _keras_shard_files(path)
        else:
            names = [path]
        files = []
        for name in names:
            opened = (
                SafetensorsTensorFile(name)
                if name.endswith(".safetensors")
                else H5TensorFile(name)
            )
            stack.callback(opened.close)
            files.append(opened)
        yield files


def _directory_weight_files(directory: str) -> list[str]:
    h5_path = os.path.join(directory, KERAS_WEIGHTS_FILE)
    if os.path.exists(h5_path):
        return [h5_path]
    safetensors = sorted(
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if name.endswith(".safetensors")
    )
    if not safetensors:
        raise CheckpointError(
            f"{directory} holds neither {KERAS_WEIGHTS_FILE} nor *.safetensors "
            "files; point at a KerasHub preset directory or a weights file."
        )
    return safetensors


def _keras_shard_files(index_path: str) -> list[str]:
    """The HDF5 files a Keras sharded-weights index (`.weights.json`) lists."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"Cannot read {index_path} as a Keras sharded-weights index ({error}); "
            "it should be the .weights.json that save_weights(max_shard_size=...) "
            "wrote."
        ) from error
    directory = os.path.dirname(os.path.abspath(index_path))
    names = sorted({name for files in weight_map.values() for name in files})
    paths = [os.path.join(directory, name) for name in names]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise CheckpointError(
            f"Shard files listed in {index_path} are missing: {missing}. Copy "
            "every shard next to the index."
        )
    return paths


def _extract_keras_weights(path: str, stack: contextlib.ExitStack) -> str:
    """Stream a `.keras` archive's weights to a temporary file (zip members
    are compressed, so hyperslabs cannot be read in place)."""
    try:
        with zipfile.ZipFile(path) as archive:
            if KERAS_WEIGHTS_FILE not in archive.namelist():
                raise CheckpointError(
                    f"{path} has no {KERAS_WEIGHTS_FILE} (members: "
                    f"{archive.namelist()}); it was not saved by model.save."
                )
            directory = stack.enter_context(
                tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path)))
            )
            target = os.path.join(directory, KERAS_WEIGHTS_FILE)
            with archive.open(KERAS_WEIGHTS_FILE) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink, length=16 * 2**20)
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise CheckpointError(
            f"Cannot read {path} as a .keras archive ({error}); it is truncated or "
            "corrupted. Re-save it with model.save."
        ) from error
    return target


# ----------------------------------------------------------------- matching
def _match_tensors(
    model, files: list[TensorFile], name_map: NameMap | None
) -> tuple[dict[str, tuple[StoredTensor, object]], list[str]]:
    """File key → (tensor, variable) for every model variable, plus skipped keys."""
    stored: dict[str, StoredTensor] = {}
    for tensor_file in files:
        for key, tensor in tensor_file.tensors().items():
            if key in stored:
                raise CheckpointError(
                    f"Tensor {key!r} is in both {stored[key].file} and "
                    f"{tensor.file}; keep one copy."
                )
            stored[key] = tensor
    by_h5_key = keras_h5_keys(model)
    by_path = {variable.path: variable for variable in by_h5_key.values()}
    has_optimizer_state = any(k.startswith(f"{OPTIMIZER_GROUP}/") for k in stored)
    targets: dict[str, tuple[StoredTensor, object]] = {}
    skipped: list[str] = []
    unknown: list[str] = []
    for key, tensor in stored.items():
        name = _mapped_name(key, name_map)
        if name is None:
            skipped.append(key)
            continue
        variable = by_path.get(name)
        if variable is None:
            variable = by_h5_key.get(name)
        if variable is None:
            if name.startswith(f"{OPTIMIZER_GROUP}/"):
                skipped.append(key)  # optimizer state for a model without one
            else:
                unknown.append(key)
            continue
        targets[key] = (tensor, variable)
    loaded = {id(variable) for _, variable in targets.values()}
    missing = [
        f"{variable.path} (file key {key})"
        for key, variable in by_h5_key.items()
        if id(variable) not in loaded
        and (has_optimizer_state or not key.startswith(f"{OPTIMIZER_GROUP}/"))
    ]
    file_names = sorted({f.path for f in files})
    if unknown or missing:
        raise CheckpointError(
            f"{file_names} do not match model {model.name!r}: "
            f"{len(unknown)} tensors with no variable {unknown[:8]}, "
            f"{len(missing)} variables not in the files {missing[:8]}. The files "
            "are from another model or a differently built one; for safetensors "
            "with other names, pass name_map."
        )
    if not has_optimizer_state and any(
        k.startswith(f"{OPTIMIZER_GROUP}/") for k in by_h5_key
    ):
        logger.info("%s hold no optimizer state; optimizer left as is", file_names)
    return targets, skipped


def _mapped_name(key: str, name_map: NameMap | None) -> str | None:
    if name_map is None:
        return key
    if callable(name_map):
        return name_map(key)
    return name_map.get(key, key)


def _owner(files: list[TensorFile], tensor: StoredTensor) -> TensorFile:
    return next(f for f in files if f.path == tensor.file)


def weights_owner(model):
    """The model whose weights file a `TensorParallel` wrapper reads and
    writes: the model it wraps (its `save_weights` writes that model's file,
    which plain Keras loads); any other model is its own owner."""
    from keras_autoshard.apply.tensor_parallel import TensorParallel

    if isinstance(model, TensorParallel):
        return model.wrapped_model
    return model


def _assign_from_slices(variable, tensor: StoredTensor, read) -> None:
    import keras

    if keras.backend.backend() == "torch":
        from keras_autoshard.io.torch.dtensor_shards import fill_local_shard

        fill_local_shard(variable, read)  # this rank's block of a DTensor
        return
    from keras_autoshard.runtime.sharded_arrays import (
        assemble_from_slices,
        release_value,
        variable_sharding,
    )

    sharding = variable_sharding(variable)
    release_value(variable)
    array = assemble_from_slices(
        tensor.shape, numpy_dtype(tensor.dtype), sharding, read
    )
    if not keras_variables.has_value(variable):
        # Created without a value: this is its first.
        keras_variables.initialize_with(variable, array)
    else:
        variable.assign(array)
