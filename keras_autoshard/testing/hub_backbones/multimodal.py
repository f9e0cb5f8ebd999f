"""Multimodal backbones, and the towers of CLIP-like models on their own."""

from __future__ import annotations

import numpy as np

from keras_autoshard.testing.hub_backbones._core import (
    HubBackboneCase,
    Sub,
    floats,
    merge,
    ones,
    tiled,
    tokens,
    zeros,
)

VOCAB = 64
SEQ = 8
IMAGE = 32
HIDDEN = 32
HEADS = 4
INTER = 64
LAYERS = 2

_image_text = merge(
    floats(IMAGE, IMAGE, 3, key="images"), tokens(SEQ, VOCAB, mask=None)
)


def _tower(kind: str) -> dict:
    """Text or vision tower config of CLIP, MetaCLIP2 or SigLIP."""
    common = dict(
        hidden_dim=HIDDEN,
        num_layers=LAYERS,
        num_heads=HEADS,
        intermediate_dim=INTER,
    )
    if kind == "vision":
        return dict(common, patch_size=8, image_shape=(IMAGE, IMAGE, 3))
    return dict(
        common,
        vocabulary_size=VOCAB,
        embedding_dim=HIDDEN,
        max_sequence_length=SEQ,
    )


def _dual(family: str, **extra) -> dict:
    return dict(
        vision_encoder=Sub(f"{family}VisionEncoder", _tower("vision")),
        text_encoder=Sub(f"{family}TextEncoder", _tower("text")),
        **extra,
    )


# === Gemma 3 / Gemma 4: one 16x16 image of 4x4 patches pooled 2x2 gives four
# vision tokens, placed at text positions 2..5 of a 16-token sequence. ========
_GEMMA_SEQ = 16
_GEMMA_IMAGE = 16
_VISION_AT = list(range(2, 6))
_vision_mask = np.zeros(_GEMMA_SEQ, dtype=bool)
_vision_mask[_VISION_AT] = True

_gemma_text = merge(
    tokens(_GEMMA_SEQ, VOCAB),
    tiled(_vision_mask, key="vision_mask", dtype="bool"),
    tiled(_VISION_AT, key="vision_indices"),
)
_GEMMA_DECODER = dict(
    vocabulary_size=VOCAB,
    image_size=_GEMMA_IMAGE,
    num_layers=LAYERS,
    num_query_heads=8,
    num_key_value_heads=4,
    hidden_dim=HIDDEN,
    intermediate_dim=INTER,
    head_dim=8,
    sliding_window_size=8,
)
_GEMMA_VISION = dict(
    image_size=_GEMMA_IMAGE,
    patch_size=4,
    pool_size=2,
    num_layers=LAYERS,
    num_heads=HEADS,
    hidden_dim=HIDDEN,
    intermediate_dim=INTER,
    output_dim=HIDDEN,
)

# Gemma 4 takes images already cut into patches: (images, patches, 4*4*3),
# with each patch's (column, row) position.
_patch_grid = np.stack(np.meshgrid(np.arange(4), np.arange(4)), -1).reshape(16, 2)
_gemma4_inputs = merge(
    _gemma_text,
    floats(1, 16, 48, key="pixel_values"),
    tiled(_patch_grid[None], key="pixel_position_ids"),
    tiled(np.arange(_GEMMA_SEQ), key="position_ids"),
)

# === Gemma 3n: text, a MobileNetV5 image tower and a conformer audio tower ===
_GEMMA3N_VISION = dict(
    stackwise_block_types=[["er"]],
    stackwise_num_blocks=[1],
    stackwise_num_filters=[[8]],
    stackwise_strides=[[1]],
    stackwise_act_layers=[["gelu"]],
    stackwise_exp_ratios=[[1.0]],
    stackwise_se_ratios=[[0.0]],
    stackwise_dw_kernel_sizes=[[0]],
    stackwise_dw_start_kernel_sizes=[[0]],
    stackwise_dw_end_kernel_sizes=[[0]],
    stackwise_exp_kernel_sizes=[[3]],
    stackwise_pw_kernel_sizes=[[1]],
    stackwise_num_heads=[[0]],
    stackwise_key_dims=[[0]],
    stackwise_value_dims=[[0]],
    stackwise_kv_strides=[[0]],
    stackwise_use_cpe=[[False]],
    num_features=4,
    image_shape=(IMAGE, IMAGE, 3),
    use_msfa=False,
)
_GEMMA3N_AUDIO = dict(
    hidden_size=4,
    input_feat_size=16,
    sscp_conv_channel_size=[2, 4],
    sscp_conv_kernel_size=[(1, 1), (1, 1)],
    sscp_conv_stride_size=[(2, 2), (2, 2)],
    sscp_conv_group_norm_eps=1e-5,
    num_hidden_layers=1,
    rms_norm_eps=1e-6,
    gradient_clipping=1.0,
    residual_weight=0.5,
    num_attention_heads=1,
    attention_chunk_size=2,
    num_attention_context_right=1,
    num_attention_context_left=1,
    attention_logit_cap=50.0,
    conv_kernel_size=3,
    reduction_factor=1,
)
# Token ids 62 and 63 are the image and audio placeholders, whose embeddings
# the image and audio features replace; random text ids stay below them.
_GEMMA3N_IMAGE_TOKEN, _GEMMA3N_AUDIO_TOKEN = VOCAB - 2, VOCAB - 1
_gemma3n_features = merge(
    tokens(SEQ, VOCAB - 2, mask_dtype="bool"),
    floats(1, IMAGE, IMAGE, 3, key="images"),
    floats(1, 8, 16, key="input_features"),
    zeros(1, 8, key="input_features_mask", dtype="bool"),
)


def _gemma3n_inputs(batch: int = 2) -> dict[str, np.ndarray]:
    inputs = _gemma3n_features(batch)
    inputs["token_ids"][:, 1:3] = _GEMMA3N_IMAGE_TOKEN
    inputs["token_ids"][:, 3:5] = _GEMMA3N_AUDIO_TOKEN
    return inputs


# === BLIP-2: ViT -> Q-Former (4 queries) -> OPT =============================
_BLIP2 = dict(
    vision_encoder=Sub(
        "BLIP2VisionEncoder",
        dict(
            image_size=IMAGE,
            patch_size=8,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
            use_patch_bias=True,
            use_class_token=True,
            use_mha_bias=True,
            use_mlp_bias=True,
            dropout_rate=0.0,
            layer_norm_epsilon=1e-6,
            initializer_range=0.02,
        ),
    ),
    qformer=Sub(
        "BLIP2QFormer",
        dict(
            num_query_tokens=4,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
            vision_dim=HIDDEN,
            cross_attention_frequency=1,
            dropout=0.0,
            layer_norm_epsilon=1e-6,
        ),
    ),
    language_model=Sub(
        "BLIP2CustomOPT",
        dict(
            vocabulary_size=VOCAB,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
            num_query_tokens=4,
            qformer_hidden_dim=HIDDEN,
            max_sequence_length=16,
            dropout=0.0,
        ),
    ),
)

# === SAM 3: 28x28 images of 14x14 patches, a text prompt and one box ========
_SAM3_IMAGE = (28, 28, 3)
_SAM3_PARTS = dict(hidden_dim=HIDDEN, intermediate_dim=INTER, num_heads=HEADS)
_SAM3 = dict(
    vision_encoder=Sub(
        "keras_hub.layers.SAM3VisionEncoder",
        dict(
            _SAM3_PARTS,
            image_shape=_SAM3_IMAGE,
            patch_size=14,
            num_layers=LAYERS,
            fpn_hidden_dim=HIDDEN,
            fpn_scale_factors=[4.0, 2.0, 1.0, 0.5],
            pretrain_image_shape=(42, 42, 3),
            window_size=2,
            global_attn_indexes=[1],
        ),
    ),
    text_encoder=Sub(
        "keras_hub.layers.SAM3TextEncoder",
        dict(_SAM3_PARTS, vocabulary_size=VOCAB, embedding_dim=HIDDEN, num_layers=2),
    ),
    geometry_encoder=Sub(
        "keras_hub.layers.SAM3GeometryEncoder",
        dict(_SAM3_PARTS, num_layers=1, roi_size=7),
    ),
    detr_encoder=Sub(
        "keras_hub.layers.SAM3DetrEncoder", dict(_SAM3_PARTS, num_layers=1)
    ),
    detr_decoder=Sub(
        "keras_hub.layers.SAM3DetrDecoder",
        dict(
            _SAM3_PARTS,
            image_shape=_SAM3_IMAGE,
            patch_size=14,
            num_layers=1,
            num_queries=8,
        ),
    ),
    mask_decoder=Sub(
        "keras_hub.layers.SAM3MaskDecoder",
        dict(num_upsampling_stages=3, hidden_dim=HIDDEN, num_heads=HEADS),
    ),
)
_sam3_inputs = merge(
    floats(*_SAM3_IMAGE, key="pixel_values"),
    tokens(16, VOCAB, mask_dtype="bool"),
    floats(1, 5, key="boxes"),
    ones(1, key="box_labels", dtype="int32"),
)

# === Diffusion: Flux and Stable Diffusion 3 =================================
_FLUX_TOKENS = 16
_flux_inputs = merge(
    floats(_FLUX_TOKENS, 16, key="image"),
    floats(_FLUX_TOKENS, 3, key="image_ids"),
    floats(SEQ, HIDDEN, key="text"),
    floats(SEQ, 3, key="text_ids"),
    floats(HIDDEN, key="y"),
    ones(key="timesteps"),
    ones(key="guidance"),
)


def _clip_text(hidden: int, activation: str, name: str) -> Sub:
    return Sub(
        "CLIPTextEncoder",
        dict(
            vocabulary_size=VOCAB,
            embedding_dim=hidden,
            hidden_dim=hidden,
            num_layers=LAYERS,
            num_heads=HEADS,
            intermediate_dim=2 * hidden,
            intermediate_activation=activation,
            intermediate_output_index=-2,
            max_sequence_length=SEQ,
            name=name,
        ),
    )


_SD3 = dict(
    mmdit_patch_size=2,
    mmdit_hidden_dim=HIDDEN,
    mmdit_num_layers=LAYERS,
    mmdit_num_heads=HEADS,
    mmdit_position_size=16,
    mmdit_qk_norm=None,
    mmdit_dual_attention_indices=None,
    vae=Sub(
        "keras_hub.src.models.vae.vae_backbone.VAEBackbone",
        dict(
            encoder_num_filters=[32, 32],
            encoder_num_blocks=[1, 1],
            decoder_num_filters=[32, 32],
            decoder_num_blocks=[1, 1],
            sampler_method="mode",
            name="vae",
        ),
    ),
    clip_l=_clip_text(HIDDEN, "quick_gelu", "clip_l"),
    clip_g=_clip_text(2 * HIDDEN, "gelu", "clip_g"),
    image_shape=(IMAGE, IMAGE, 3),
)
_sd3_inputs = merge(
    floats(IMAGE, IMAGE, 3, key="images"),
    floats(IMAGE // 8, IMAGE // 8, 16, key="latents"),
    *(
        tokens(SEQ, VOCAB, ids=f"clip_{tower}{negative}_token_ids", mask=None)
        for tower in ("l", "g")
        for negative in ("", "_negative")
    ),
    ones(key="num_steps", dtype="int32"),
    ones(key="guidance_scale"),
)

# === PARSeq: a ViT over 16x32 text-line crops and an 8-token label decoder ==
_PARSEQ = dict(
    image_encoder=Sub(
        "ViTBackbone",
        dict(
            image_shape=(16, IMAGE, 3),
            patch_size=(4, 8),
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            mlp_dim=INTER,
            use_class_token=False,
            name="image_encoder",
        ),
    ),
    vocabulary_size=VOCAB,
    max_label_length=SEQ,
    decoder_hidden_dim=HIDDEN,
    num_decoder_layers=1,
    num_decoder_heads=HEADS,
    decoder_mlp_dim=INTER,
    dropout_rate=0.0,
    attention_dropout=0.0,
)
_parseq_inputs = merge(floats(16, IMAGE, 3, key="images"), tokens(SEQ, VOCAB))


def _multi(name: str, config: dict, make_inputs) -> HubBackboneCase:
    return HubBackboneCase(name, config, make_inputs, "multimodal")


MULTIMODAL_CASES = [
    _multi(
        "BLIP2Backbone",
        _BLIP2,
        merge(
            floats(IMAGE, IMAGE, 3, key="images"), tokens(SEQ, VOCAB, mask_dtype="bool")
        ),
    ),
    _multi("CLIPBackbone", _dual("CLIP", projection_dim=HIDDEN), _image_text),
    HubBackboneCase(
        "CLIPTextEncoder",
        _tower("text"),
        tokens(SEQ, VOCAB, mask=None),
        "text",
    ),
    HubBackboneCase(
        "CLIPVisionEncoder",
        _tower("vision"),
        floats(IMAGE, IMAGE, 3, key="images"),
        "vision",
    ),
    _multi(
        "FluxBackbone",
        dict(
            input_channels=16,
            hidden_size=HIDDEN * 2,
            mlp_ratio=2.0,
            num_heads=HEADS,
            depth=1,
            depth_single_blocks=1,
            axes_dim=[4, 6, 6],
            theta=10_000,
            use_bias=True,
            guidance_embed=True,
            image_shape=(_FLUX_TOKENS, 16),
            text_shape=(SEQ, HIDDEN),
            image_ids_shape=(_FLUX_TOKENS, 3),
            text_ids_shape=(SEQ, 3),
            y_shape=(HIDDEN,),
        ),
        _flux_inputs,
    ),
    _multi(
        "Gemma3Backbone",
        dict(_GEMMA_DECODER, vision_encoder=Sub("Gemma3VisionEncoder", _GEMMA_VISION)),
        merge(_gemma_text, floats(1, _GEMMA_IMAGE, _GEMMA_IMAGE, 3, key="images")),
    ),
    _multi(
        "Gemma3nBackbone",
        dict(
            text_vocab_size=VOCAB,
            text_hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            pad_token_id=0,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=[INTER] * LAYERS,
            hidden_activation="gelu_approximate",
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            rope_theta=10000.0,
            max_position_embeddings=16,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            altup_num_inputs=2,
            laurel_rank=4,
            vision_encoder_config=_GEMMA3N_VISION,
            vision_hidden_size=8,
            image_token_id=_GEMMA3N_IMAGE_TOKEN,
            audio_encoder_config=_GEMMA3N_AUDIO,
            audio_hidden_size=4,
            audio_token_id=_GEMMA3N_AUDIO_TOKEN,
        ),
        _gemma3n_inputs,
    ),
    _multi(
        "Gemma4Backbone",
        dict(
            _GEMMA_DECODER,
            vision_encoder=Sub(
                "Gemma4VisionEncoder",
                dict(_GEMMA_VISION, head_dim=8, num_key_value_heads=HEADS),
            ),
        ),
        _gemma4_inputs,
    ),
    _multi("MetaCLIP2Backbone", _dual("MetaCLIP2", projection_dim=HIDDEN), _image_text),
    HubBackboneCase(
        "MetaCLIP2TextEncoder",
        _tower("text"),
        tokens(SEQ, VOCAB, mask=None),
        "text",
    ),
    HubBackboneCase(
        "MetaCLIP2VisionEncoder",
        _tower("vision"),
        floats(IMAGE, IMAGE, 3, key="images"),
        "vision",
    ),
    _multi("PARSeqBackbone", _PARSEQ, _parseq_inputs),
    _multi(
        "PaliGemmaBackbone",
        dict(
            vocabulary_size=VOCAB,
            image_size=_GEMMA_IMAGE,
            num_layers=LAYERS,
            num_query_heads=8,
            num_key_value_heads=4,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
            head_dim=8,
            vit_patch_size=4,
            vit_num_layers=LAYERS,
            vit_num_heads=HEADS,
            vit_hidden_dim=HIDDEN,
            vit_intermediate_dim=INTER,
        ),
        merge(
            floats(_GEMMA_IMAGE, _GEMMA_IMAGE, 3, key="images"),
            tokens(SEQ, VOCAB),
            zeros(SEQ, key="response_mask", dtype="int32"),
        ),
    ),
    _multi("SAM3PromptableConceptBackbone", _SAM3, _sam3_inputs),
    _multi("SigLIPBackbone", _dual("SigLIP"), _image_text),
    HubBackboneCase(
        "SigLIPTextEncoder",
        _tower("text"),
        tokens(SEQ, VOCAB, mask=None),
        "text",
    ),
    HubBackboneCase(
        "SigLIPVisionEncoder",
        _tower("vision"),
        floats(IMAGE, IMAGE, 3, key="images"),
        "vision",
    ),
    _multi("StableDiffusion3Backbone", _SD3, _sd3_inputs),
]
