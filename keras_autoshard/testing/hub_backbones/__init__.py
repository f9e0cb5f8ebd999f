"""Small, fast configurations of every `Backbone` class keras-hub exports.

`CASES` maps each class name in `keras_hub.models` that subclasses
`keras_hub.models.Backbone` to a `HubBackboneCase`: constructor kwargs, a
function making an input batch of a given size, and the modality. `build(case)`
constructs the model with no downloads; `exported_backbone_classes()` lists the
classes, so a test can check that `CASES` covers them all.

Where the configs come from: keras-hub's own backbone tests
(`keras_hub/src/models/<name>/<name>_backbone_test.py` in
github.com/keras-team/keras-hub, their `init_kwargs` and `input_data`), adapted
to the signatures of keras-hub 0.32.0 (required arguments that the tests of
the repository's HEAD leave out, exported names of sub-models) and resized for
sharding tests: hidden sizes of at most 64 (32 mostly), 1 or 2 layers, a
vocabulary of 64, sequences of 8 or 16 tokens, 32x32 images where the class
allows, and head, hidden and intermediate sizes that 4 and 8 divide where they
are free, so that a batch of 8 shards on 2x4, 1x8 and 8x1 meshes. Classes with
no backbone test in the repository reuse the config of the sibling they alias
or share code with (Llama3 <- Llama, Qwen/Qwen2 <- QwenMoe, SmolLM <- SmolLM3,
ESM2 <- ESM) or of the composite model's test (the CLIP / MetaCLIP2 / SigLIP
towers); FeaturePyramidBackbone, a base class, is built as a functional model
over a three-level conv pyramid written here. Sub-models (image encoders,
towers) are `Sub` specs, which `build` constructs afresh on every call.

Sizes forced by a class: ResNet's first stage must have 64 filters (and
BASNet's `projection_filters` must match the ResNet stem, hence a thin stem
with bottleneck blocks, whose first stage outputs 256 channels); DeepLabV3 and
RetinaNet have fixed 256-filter heads; DepthAnything needs a 7x7 patch grid
(98x98 images) for its valid convolutions at the 0.5x reassemble level;
DINOv2 and SAM 3 have 14-pixel patches (28x28 images).

Known quirks (keras-hub's, not the configs'): SAMBackbone's
`prompt_dense_positional_embeddings` output has batch size 1 whatever the
input's; SAM 3's geometry encoder hands `ops.dot_product_attention` a
(batch, prompts) mask, so for a batch size other than its prompt length (2)
JAX's XLA attention raises and Keras logs the traceback, then falls back to
its own implementation, which runs (the mask is all true). The Qwen3.5 models
unroll a 64-step Python loop in their gated delta rule, which makes their
eager forward pass the slowest of all (about a minute on 2 CPU cores).
"""

from keras_autoshard.testing.hub_backbones._core import (
    MODALITIES,
    HubBackboneCase,
    Sub,
    build,
    exported_backbone_classes,
    materialize,
)
from keras_autoshard.testing.hub_backbones.multimodal import MULTIMODAL_CASES
from keras_autoshard.testing.hub_backbones.text import TEXT_CASES
from keras_autoshard.testing.hub_backbones.vision import VISION_CASES

CASES: dict[str, HubBackboneCase] = {
    case.class_name: case
    for case in sorted(
        TEXT_CASES + VISION_CASES + MULTIMODAL_CASES, key=lambda c: c.class_name
    )
}

__all__ = [
    "CASES",
    "MODALITIES",
    "HubBackboneCase",
    "Sub",
    "build",
    "exported_backbone_classes",
    "materialize",
]
