"""Vision backbones: CNNs, vision transformers, detection and dense heads."""

from __future__ import annotations

from keras_autoshard.testing.hub_backbones._core import (
    HubBackboneCase,
    Sub,
    floats,
    merge,
    ones,
    zeros,
)

IMAGE = 32
HIDDEN = 32
HEADS = 4
INTER = 64
LAYERS = 2
IMAGE_SHAPE = (IMAGE, IMAGE, 3)

_images = floats(IMAGE, IMAGE, 3)


def _vision(name: str, config: dict, make_inputs=_images) -> HubBackboneCase:
    return HubBackboneCase(name, config, make_inputs, "vision")


def _resnet(filters, strides, stem=64, block="basic_block", **extra) -> Sub:
    """A one-block-per-stage ResNet; the first stage must have 64 filters."""
    return Sub(
        "ResNetBackbone",
        dict(
            input_conv_filters=[stem],
            input_conv_kernel_sizes=[3],
            stackwise_num_filters=list(filters),
            stackwise_num_blocks=[1] * len(filters),
            stackwise_num_strides=list(strides),
            block_type=block,
            use_pre_activation=False,
            **extra,
        ),
    )


_MIT = dict(
    layerwise_depths=[1, 1],
    image_shape=IMAGE_SHAPE,
    hidden_dims=[16, 32],
    num_layers=2,
    layerwise_num_heads=[1, 2],
    layerwise_sr_ratios=[8, 4],
    max_drop_path_rate=0.1,
    layerwise_patch_sizes=[7, 3],
    layerwise_strides=[4, 2],
)

# HGNetV2 of the D-FINE test: stages of 16 and 32 channels.
_HGNETV2 = dict(
    stem_channels=[3, 8, 8],
    stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]],
    apply_downsample=[False, True],
    use_lightweight_conv_block=[False, False],
    depths=[1, 1],
    hidden_sizes=[16, 32],
    embedding_size=8,
    use_learnable_affine_block=True,
    hidden_act="relu",
    image_shape=IMAGE_SHAPE,
    out_features=["stage1", "stage2"],
)

_DINOV2 = dict(
    patch_size=14,
    num_layers=LAYERS,
    hidden_dim=HIDDEN,
    num_heads=HEADS,
    intermediate_dim=INTER,
    layer_scale_init_value=1.0,
    num_register_tokens=0,
    use_swiglu_ffn=False,
    image_shape=(28, 28, 3),
)

_VITDET = dict(
    hidden_size=HIDDEN,
    num_layers=LAYERS,
    intermediate_dim=INTER,
    num_heads=HEADS,
    global_attention_layer_indices=[1],
    patch_size=4,
    num_output_channels=16,
    window_size=4,
    image_shape=IMAGE_SHAPE,
)


def _pyramid_outputs(images):
    """A tiny conv pyramid: P1..P3 at strides 2, 4, 8."""
    import keras

    outputs, x = {}, images
    for level, filters in ((1, 8), (2, 16), (3, 32)):
        x = keras.layers.Conv2D(filters, 3, strides=2, padding="same")(x)
        outputs[f"P{level}"] = x
    return outputs


_PYRAMID_IMAGES = Sub("keras.Input", dict(shape=IMAGE_SHAPE, name="images"))

# SAM at 32x32 with 4x4 patches: an 8x8 image embedding of 16 channels.
_SAM = dict(
    image_encoder=Sub("ViTDetBackbone", dict(_VITDET)),
    prompt_encoder=Sub(
        "keras_hub.src.models.sam.sam_prompt_encoder.SAMPromptEncoder",
        dict(
            hidden_size=16,
            image_embedding_size=(8, 8),
            input_image_size=(IMAGE, IMAGE),
            mask_in_channels=16,
        ),
    ),
    mask_decoder=Sub(
        "keras_hub.src.models.sam.sam_mask_decoder.SAMMaskDecoder",
        dict(
            num_layers=2,
            hidden_size=16,
            intermediate_dim=32,
            num_heads=4,
            embedding_dim=16,
            num_multimask_outputs=3,
            iou_head_depth=2,
            iou_head_hidden_dim=16,
        ),
    ),
)
_sam_inputs = merge(
    floats(IMAGE, IMAGE, 3, key="images"),
    floats(1, 2, key="points", high=IMAGE),
    ones(1, key="labels"),
    floats(1, 2, 2, key="boxes", high=IMAGE),
    zeros(0, IMAGE, IMAGE, 1, key="masks"),
)


VISION_CASES = [
    _vision(
        "BASNetBackbone",
        dict(
            # The bridge and decoder have 8 * projection_filters channels, and
            # projection_filters must match the ResNet stem: a thin stem needs
            # bottleneck blocks (their first block has a conv shortcut).
            image_encoder=_resnet(
                [64, 16, 16, 16], [1, 2, 2, 2], stem=8, block="bottleneck_block"
            ),
            num_classes=1,
            image_shape=IMAGE_SHAPE,
            projection_filters=8,
        ),
    ),
    _vision(
        "CSPNetBackbone",
        dict(
            stem_filters=16,
            stem_kernel_size=3,
            stem_strides=1,
            stackwise_strides=2,
            stackwise_depth=[1, 1],
            stackwise_num_filters=[16, 32],
            image_shape=IMAGE_SHAPE,
            down_growth=True,
            bottle_ratio=(0.5, 1.0),
            block_ratio=(1.0, 0.5),
            expand_ratio=(2.0, 1.0),
            block_type="dark_block",
            stage_type="csp",
            stem_padding="same",
        ),
    ),
    _vision(
        "DFineBackbone",
        dict(
            backbone=Sub("HGNetV2Backbone", dict(_HGNETV2)),
            decoder_in_channels=[16, 16],
            encoder_hidden_dim=16,
            num_denoising=0,
            num_labels=4,
            hidden_dim=16,
            learn_initial_query=False,
            num_queries=8,
            anchor_image_size=(IMAGE, IMAGE),
            feat_strides=[4, 8],
            num_feature_levels=2,
            encoder_in_channels=[16, 32],
            encode_proj_layers=[1],
            num_attention_heads=2,
            encoder_ffn_dim=32,
            num_encoder_layers=1,
            hidden_expansion=0.5,
            depth_multiplier=0.5,
            eval_idx=-1,
            num_decoder_layers=2,
            decoder_attention_heads=2,
            decoder_ffn_dim=32,
            decoder_n_points=[2, 2],
            lqe_hidden_dim=16,
            num_lqe_layers=2,
            out_features=["stage1", "stage2"],
            image_shape=IMAGE_SHAPE,
            seed=0,
        ),
    ),
    _vision("DINOV2Backbone", dict(_DINOV2), floats(28, 28, 3, key="images")),
    _vision(
        "DINOV3Backbone",
        dict(
            patch_size=16,
            num_layers=LAYERS,
            hidden_dim=HIDDEN,
            num_heads=HEADS,
            intermediate_dim=INTER,
            num_register_tokens=4,
            image_shape=IMAGE_SHAPE,
        ),
        floats(IMAGE, IMAGE, 3, key="pixel_values"),
    ),
    _vision(
        "DeepLabV3Backbone",
        dict(
            image_encoder=_resnet([64, 32, 32], [1, 2, 2]),
            low_level_feature_key="P2",
            spatial_pyramid_pooling_key="P4",
            dilation_rates=[6, 12, 18],
            upsampling_size=4,
            projection_filters=16,
            image_shape=IMAGE_SHAPE,
        ),
    ),
    _vision(
        "DeiTBackbone",
        dict(
            image_shape=IMAGE_SHAPE,
            patch_size=8,
            num_layers=LAYERS,
            hidden_dim=HIDDEN,
            num_heads=HEADS,
            intermediate_dim=INTER,
        ),
    ),
    _vision(
        "DenseNetBackbone",
        dict(stackwise_num_repeats=[2, 2], growth_rate=8, image_shape=IMAGE_SHAPE),
    ),
    _vision(
        "DepthAnythingBackbone",
        dict(
            image_encoder=Sub(
                "DINOV2Backbone",
                dict(
                    _DINOV2,
                    num_layers=4,
                    image_shape=(98, 98, 3),
                    apply_layernorm=True,
                    name="encoder",
                ),
            ),
            reassemble_factors=[4, 2, 1, 0.5],
            neck_hidden_dims=[8, 16, 32, 64],
            fusion_hidden_dim=32,
            head_hidden_dim=8,
            head_in_index=-1,
            feature_keys=["stage1", "stage2", "stage3", "stage4"],
        ),
        floats(98, 98, 3),
    ),
    _vision(
        "EfficientNetBackbone",
        dict(
            stackwise_kernel_sizes=[3, 3],
            stackwise_num_repeats=[1, 1],
            stackwise_input_filters=[16, 16],
            stackwise_output_filters=[16, 32],
            stackwise_expansion_ratios=[1, 4],
            stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
            stackwise_strides=[1, 2],
            stackwise_block_types=["fused", "unfused"],
            stackwise_force_input_filters=[0, 0],
            stackwise_nores_option=[False, False],
            stackwise_width_coefficients=[1.0, 1.0],
            stackwise_depth_coefficients=[1.0, 1.0],
            num_features=64,
            input_shape=IMAGE_SHAPE,
        ),
    ),
    _vision(
        "FeaturePyramidBackbone",
        dict(
            inputs=_PYRAMID_IMAGES,
            outputs=Sub(_pyramid_outputs, dict(images=_PYRAMID_IMAGES)),
        ),
    ),
    _vision("HGNetV2Backbone", dict(_HGNETV2)),
    _vision("MiTBackbone", dict(_MIT)),
    _vision(
        "MobileNetBackbone",
        dict(
            stackwise_expansion=[[16, 32], [64, 64]],
            stackwise_num_blocks=[2, 2],
            stackwise_num_filters=[[16, 16], [32, 32]],
            stackwise_kernel_size=[[3, 3], [5, 5]],
            stackwise_num_strides=[[2, 1], [2, 1]],
            stackwise_se_ratio=[[None, None], [0.25, 0.25]],
            stackwise_activation=[
                ["relu", "relu"],
                ["hard_swish", "hard_swish"],
                ["hard_swish"],
            ],
            stackwise_padding=[[1, 1], [2, 2]],
            output_num_filters=64,
            input_activation="hard_swish",
            output_activation="hard_swish",
            input_num_filters=16,
            image_shape=IMAGE_SHAPE,
            depthwise_filters=8,
            depthwise_stride=2,
            depthwise_residual=False,
            squeeze_and_excite=0.5,
            last_layer_filter=64,
        ),
    ),
    _vision(
        "MobileNetV5Backbone",
        dict(
            stackwise_block_types=[["er"], ["uir", "uir"]],
            stackwise_num_blocks=[1, 2],
            stackwise_num_filters=[[16], [32, 32]],
            stackwise_strides=[[2], [2, 1]],
            stackwise_act_layers=[["relu"], ["relu", "relu"]],
            stackwise_exp_ratios=[[4.0], [4.0, 4.0]],
            stackwise_se_ratios=[[0.0], [0.0, 0.0]],
            stackwise_dw_kernel_sizes=[[0], [5, 5]],
            stackwise_dw_start_kernel_sizes=[[0], [0, 0]],
            stackwise_dw_end_kernel_sizes=[[0], [0, 0]],
            stackwise_exp_kernel_sizes=[[3], [0, 0]],
            stackwise_pw_kernel_sizes=[[1], [0, 0]],
            stackwise_num_heads=[[0], [0, 0]],
            stackwise_key_dims=[[0], [0, 0]],
            stackwise_value_dims=[[0], [0, 0]],
            stackwise_kv_strides=[[0], [0, 0]],
            stackwise_use_cpe=[[False], [False, False]],
            image_shape=IMAGE_SHAPE,
            stem_size=16,
            num_features=64,
            use_msfa=False,
        ),
    ),
    _vision(
        "ResNetBackbone",
        _resnet([64, 32], [1, 2], image_shape=IMAGE_SHAPE).config,
    ),
    _vision(
        "RetinaNetBackbone",
        dict(
            image_encoder=_resnet([64, 32, 32, 32], [1, 2, 2, 2]),
            min_level=3,
            max_level=6,
            use_p5=True,
            image_shape=IMAGE_SHAPE,
        ),
    ),
    _vision("SAMBackbone", _SAM, _sam_inputs),
    _vision(
        "SegFormerBackbone",
        dict(image_encoder=Sub("MiTBackbone", dict(_MIT)), projection_filters=32),
    ),
    _vision(
        "SwinTransformerBackbone",
        dict(
            image_shape=IMAGE_SHAPE,
            embed_dim=HIDDEN,
            depths=(2, 2),
            num_heads=(2, 4),
            window_size=4,
        ),
    ),
    _vision(
        "VGGBackbone",
        dict(
            stackwise_num_repeats=[1, 1, 1],
            stackwise_num_filters=[8, 16, 32],
            image_shape=IMAGE_SHAPE,
        ),
    ),
    _vision(
        "ViTBackbone",
        dict(
            image_shape=IMAGE_SHAPE,
            patch_size=(8, 8),
            num_layers=LAYERS,
            hidden_dim=HIDDEN,
            num_heads=HEADS,
            mlp_dim=INTER,
        ),
    ),
    _vision("ViTDetBackbone", dict(_VITDET)),
    _vision(
        "VideoPrismBackbone",
        dict(
            image_shape=(16, 16, 3),
            num_frames=4,
            patch_size=4,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
            num_heads=HEADS,
            num_spatial_layers=1,
            num_temporal_layers=1,
            num_auxiliary_layers=1,
        ),
        floats(4, 16, 16, 3),  # (frames, height, width, channels)
    ),
    _vision(
        "XceptionBackbone",
        dict(
            stackwise_conv_filters=[[8, 16], [32, 32], [64, 64]],
            stackwise_pooling=[False, True, False],
            image_shape=IMAGE_SHAPE,
        ),
    ),
]
