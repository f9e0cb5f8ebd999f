"""The case type, nested sub-model specs, `build` and input-batch makers."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

MODALITIES = ("text", "vision", "audio", "multimodal")

InputMaker = Callable[[int], Any]


@dataclasses.dataclass(frozen=True)
class HubBackboneCase:
    """A small configuration of one exported keras-hub backbone class.

    Args:
        class_name: The name of the class in `keras_hub.models`.
        config: Its constructor kwargs. Nested models (image encoders, the
            towers of CLIP-like models...) are given as `Sub` specs, which
            `build` constructs afresh on every call.
        make_inputs: `make_inputs(batch_size)` gives an input batch (numpy
            arrays, a dict keyed like the model's inputs where it has several).
        modality: "text", "vision", "audio" or "multimodal".
        skip_reason: Why the backbone cannot be built or called in JAX on CPU
            here, or None when it can.
    """

    class_name: str
    config: dict
    make_inputs: InputMaker
    modality: str
    skip_reason: str | None = None

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"{self.class_name}: bad modality {self.modality!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Sub:
    """A nested object of a config, constructed when the case is built.

    Args:
        target: What to call: a class name in `keras_hub.models`, a dotted
            import path (`"keras_hub.src.models.sam.sam_mask_decoder.
            SAMMaskDecoder"`, `"keras.Input"`), or a callable.
        config: Its kwargs, which may hold further `Sub`s.

    Within one `build`, each `Sub` object is constructed once, so a spec
    used twice in a config (a functional graph's `inputs` and the `outputs`
    computed from them) gives the same object both times.
    """

    target: str | Callable[..., Any]
    config: dict = dataclasses.field(default_factory=dict)


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(target):
        return target
    if "." not in target:
        import keras_hub

        return getattr(keras_hub.models, target)
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def materialize(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """`value` with every `Sub` in it (dicts, lists, tuples) constructed."""
    memo = {} if memo is None else memo
    if isinstance(value, Sub):
        if id(value) not in memo:
            kwargs = materialize(value.config, memo)
            memo[id(value)] = _resolve(value.target)(**kwargs)
        return memo[id(value)]
    if isinstance(value, Mapping):
        return {k: materialize(v, memo) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v, memo) for v in value]
    if isinstance(value, tuple):
        return tuple(materialize(v, memo) for v in value)
    return value


def build(case: HubBackboneCase):
    """`keras_hub.models.<class_name>(**config)`, nested `Sub`s constructed."""
    import keras_hub

    cls = getattr(keras_hub.models, case.class_name)
    return cls(**materialize(case.config))


def exported_backbone_classes() -> list[str]:
    """Every class in `keras_hub.models` that subclasses `Backbone` (sorted)."""
    import keras_hub

    base = keras_hub.models.Backbone
    names = []
    for name in dir(keras_hub.models):
        obj = getattr(keras_hub.models, name)
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base:
            names.append(name)
    return sorted(names)


# === Input batch makers =====================================================
# Each maker is `make(batch_size=2) -> batch`, deterministic in batch_size.


def _rng(batch: int, salt: int = 0) -> np.random.Generator:
    return np.random.default_rng(1000 * salt + batch)


def tokens(
    seq: int,
    vocab: int,
    *,
    ids: str = "token_ids",
    mask: str | None = "padding_mask",
    segments: str | None = None,
    mask_dtype: str = "int32",
    low: int = 1,
) -> InputMaker:
    """Random token ids in [low, vocab), an all-ones mask, zero segments."""

    def make(batch: int = 2) -> dict[str, np.ndarray]:
        rng = _rng(batch, seq)
        out = {ids: rng.integers(low, vocab, (batch, seq), dtype="int32")}
        if mask is not None:
            out[mask] = np.ones((batch, seq), dtype=mask_dtype)
        if segments is not None:
            out[segments] = np.zeros((batch, seq), dtype="int32")
        return out

    return make


def floats(*shape: int, key: str | None = None, low=0.0, high=1.0) -> InputMaker:
    """Uniform float32 of shape (batch, *shape), bare or as {key: array}."""

    def make(batch: int = 2):
        rng = _rng(batch, sum(shape))
        array = rng.uniform(low, high, (batch, *shape)).astype("float32")
        return array if key is None else {key: array}

    return make


def ones(*shape: int, key: str, dtype: str = "float32") -> InputMaker:
    """{key: ones of shape (batch, *shape)}."""
    return lambda batch=2: {key: np.ones((batch, *shape), dtype=dtype)}


def zeros(*shape: int, key: str, dtype: str = "float32") -> InputMaker:
    """{key: zeros of shape (batch, *shape)}."""
    return lambda batch=2: {key: np.zeros((batch, *shape), dtype=dtype)}


def tiled(row, *, key: str, dtype: str = "int32") -> InputMaker:
    """{key: `row` repeated along a new leading batch axis}."""
    array = np.asarray(row, dtype=dtype)
    return lambda batch=2: {key: np.broadcast_to(array, (batch, *array.shape)).copy()}


def merge(*makers: InputMaker) -> InputMaker:
    """One dict batch from several dict-valued makers."""

    def make(batch: int = 2) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for maker in makers:
            out.update(maker(batch))
        return out

    return make


def prefixed(prefix: str, maker: InputMaker) -> InputMaker:
    """A dict maker with `prefix` put before every key."""
    return lambda batch=2: {prefix + k: v for k, v in maker(batch).items()}
