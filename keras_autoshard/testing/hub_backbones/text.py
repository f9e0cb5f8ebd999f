"""Text (and audio-to-text) backbones: encoders, decoders, seq2seq, MoE."""

from __future__ import annotations

from keras_autoshard.testing.hub_backbones._core import (
    HubBackboneCase,
    floats,
    merge,
    ones,
    prefixed,
    tokens,
)

VOCAB = 64
SEQ = 8
MAX_SEQ = 16
HIDDEN = 32
HEADS = 4
INTER = 64
LAYERS = 2

# BERT-like shape shared by most encoder and decoder-only models.
_BASIC = dict(
    vocabulary_size=VOCAB,
    num_layers=LAYERS,
    num_heads=HEADS,
    hidden_dim=HIDDEN,
    intermediate_dim=INTER,
)
# Grouped-query attention decoders (Llama family): 8 query, 4 key/value heads.
_GQA = dict(
    vocabulary_size=VOCAB,
    num_layers=LAYERS,
    num_query_heads=8,
    num_key_value_heads=4,
    hidden_dim=HIDDEN,
    intermediate_dim=INTER,
)

_ids_mask = tokens(SEQ, VOCAB)
_ids_segments_mask = tokens(SEQ, VOCAB, segments="segment_ids")
_ids_segments = tokens(SEQ, VOCAB, mask=None, segments="segment_ids")
_seq2seq = merge(
    prefixed("encoder_", tokens(SEQ, VOCAB)),
    prefixed("decoder_", tokens(SEQ, VOCAB)),
)


def _text(name: str, config: dict, make_inputs=_ids_mask) -> HubBackboneCase:
    return HubBackboneCase(name, config, make_inputs, "text")


def _moe_qwen(**extra) -> dict:
    return dict(
        _GQA,
        moe_intermediate_dim=HIDDEN,
        num_experts=4,
        top_k=2,
        norm_top_k_prob=True,
        **extra,
    )


_QWEN3_5 = dict(
    vocabulary_size=VOCAB,
    num_layers=LAYERS,
    num_query_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    hidden_dim=HIDDEN,
    layer_types=["linear_attention", "full_attention"],
    partial_rotary_factor=0.25,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=4,
    linear_value_head_dim=4,
    linear_conv_kernel_dim=4,
)

_SMOLLM3 = dict(
    vocabulary_size=VOCAB,
    hidden_dim=HIDDEN,
    intermediate_dim=INTER,
    num_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=4,
    attention_bias=False,
    attention_dropout=0.0,
    rope_layer_enabled_list=[True, True],
    layer_types=["attention", "attention"],
    mlp_bias=False,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=MAX_SEQ,
    rope_theta=10000.0,
    partial_rotary_factor=1.0,
)


def _t5gemma(**extra) -> dict:
    side = dict(
        hidden_dim=HIDDEN,
        intermediate_dim=INTER,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    config = {
        f"{part}_{k}": v for part in ("encoder", "decoder") for k, v in side.items()
    }
    return dict(
        config,
        vocabulary_size=VOCAB,
        sliding_window=4,
        cross_attention_hidden_size=HIDDEN,
        attn_logit_softcapping=50.0,
        **extra,
    )


# Moonshine takes raw 16 kHz audio; 2048 samples (0.128 s) give a few frames
# after its three strided convolutions (strides 64, 3, 2).
_MOONSHINE_SAMPLES = 2048
_moonshine_inputs = merge(
    floats(_MOONSHINE_SAMPLES, 1, key="encoder_input_values", low=-1.0),
    ones(_MOONSHINE_SAMPLES, key="encoder_padding_mask", dtype="bool"),
    tokens(SEQ, VOCAB, ids="decoder_token_ids", mask="decoder_padding_mask"),
)

# Whisper takes log-mel features (batch, frames, num_mels).
_WHISPER_MELS = 16
_whisper_inputs = merge(
    floats(MAX_SEQ, _WHISPER_MELS, key="encoder_features", low=-1.0),
    tokens(SEQ, VOCAB, ids="decoder_token_ids", mask="decoder_padding_mask"),
)

TEXT_CASES = [
    _text(
        "AlbertBackbone",
        dict(
            _BASIC,
            embedding_dim=16,
            num_groups=1,
            num_inner_repetitions=1,
            max_sequence_length=MAX_SEQ,
        ),
        _ids_segments_mask,
    ),
    _text("BartBackbone", dict(_BASIC, max_sequence_length=MAX_SEQ), _seq2seq),
    _text(
        "BertBackbone", dict(_BASIC, max_sequence_length=MAX_SEQ), _ids_segments_mask
    ),
    _text("BloomBackbone", dict(_BASIC)),
    _text(
        "DebertaV3Backbone",
        dict(_BASIC, max_sequence_length=MAX_SEQ, bucket_size=8),
    ),
    _text("DistilBertBackbone", dict(_BASIC, max_sequence_length=MAX_SEQ)),
    _text(
        "ESM2Backbone",
        dict(_BASIC, max_sequence_length=MAX_SEQ),
        tokens(SEQ, VOCAB, mask=None),
    ),
    _text(
        "ESMBackbone",
        dict(_BASIC, max_sequence_length=MAX_SEQ),
        tokens(SEQ, VOCAB, mask=None),
    ),
    _text(
        "EdRecBackbone",
        dict(
            vocab_size=VOCAB,
            num_layers_enc=LAYERS,
            num_layers_dec=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
        ),
        _seq2seq,
    ),
    _text(
        "ElectraBackbone",
        dict(
            vocab_size=VOCAB,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            embedding_dim=16,
            intermediate_dim=INTER,
            max_sequence_length=MAX_SEQ,
        ),
        _ids_segments_mask,
    ),
    _text(
        "FNetBackbone",
        dict(
            vocabulary_size=VOCAB,
            num_layers=LAYERS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
            max_sequence_length=MAX_SEQ,
        ),
        _ids_segments,
    ),
    _text(
        "FalconBackbone",
        dict(
            vocabulary_size=VOCAB,
            num_layers=LAYERS,
            num_attention_heads=HEADS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
        ),
    ),
    _text("GPT2Backbone", dict(_BASIC, max_sequence_length=MAX_SEQ)),
    _text("GPTNeoXBackbone", dict(_BASIC, max_sequence_length=MAX_SEQ)),
    _text("GemmaBackbone", dict(_GQA, head_dim=8)),
    _text("GptOssBackbone", dict(_GQA, num_experts=4, top_k=2, sliding_window=4)),
    _text("Llama3Backbone", dict(_GQA)),
    _text("LlamaBackbone", dict(_GQA)),
    _text("MistralBackbone", dict(_GQA, sliding_window=4)),
    _text("MixtralBackbone", dict(_GQA, num_experts=4, top_k=2, sliding_window=4)),
    _text("OPTBackbone", dict(_BASIC, max_sequence_length=MAX_SEQ)),
    _text("Phi3Backbone", dict(_GQA, max_sequence_length=MAX_SEQ)),
    _text("Qwen2Backbone", dict(_GQA)),
    _text("Qwen3Backbone", dict(_GQA, head_dim=4)),
    _text("Qwen3MoeBackbone", _moe_qwen(head_dim=4)),
    _text("Qwen3_5Backbone", dict(_QWEN3_5, intermediate_dim=INTER)),
    _text(
        "Qwen3_5MoeBackbone",
        dict(
            _QWEN3_5,
            moe_intermediate_dim=HIDDEN,
            shared_expert_intermediate_size=HIDDEN,
            num_experts=4,
            top_k=2,
        ),
    ),
    _text("QwenBackbone", dict(_GQA)),
    _text("QwenMoeBackbone", _moe_qwen(shared_expert_intermediate_dim=INTER)),
    _text(
        "RWKV7Backbone",
        dict(
            vocabulary_size=VOCAB,
            hidden_size=HIDDEN,
            num_layers=LAYERS,
            head_size=8,
            intermediate_dim=INTER,
            gate_lora=16,
            mv_lora=8,
            aaa_lora=8,
            decay_lora=8,
        ),
    ),
    _text("RobertaBackbone", dict(_BASIC, max_sequence_length=MAX_SEQ)),
    _text("RoformerV2Backbone", dict(_BASIC, head_size=8), _ids_segments),
    _text("SmolLM3Backbone", dict(_SMOLLM3)),
    _text("SmolLMBackbone", dict(_SMOLLM3)),
    _text("T5Backbone", dict(_BASIC), _seq2seq),
    _text("T5Gemma2Backbone", _t5gemma(use_query_key_norm=True), _seq2seq),
    _text("T5GemmaBackbone", _t5gemma(), _seq2seq),
    _text("XLMRobertaBackbone", dict(_BASIC, max_sequence_length=MAX_SEQ)),
    _text("XLNetBackbone", dict(_BASIC), _ids_segments_mask),
    HubBackboneCase(
        "MoonshineBackbone",
        dict(
            vocabulary_size=VOCAB,
            filter_dim=HIDDEN,
            encoder_num_layers=LAYERS,
            decoder_num_layers=LAYERS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTER,
            encoder_num_heads=HEADS,
            decoder_num_heads=HEADS,
            feedforward_expansion_factor=2,
            max_position_embeddings=64,
        ),
        _moonshine_inputs,
        "audio",
    ),
    HubBackboneCase(
        "WhisperBackbone",
        dict(
            _BASIC,
            num_mels=_WHISPER_MELS,
            max_encoder_sequence_length=MAX_SEQ,
            max_decoder_sequence_length=MAX_SEQ,
        ),
        _whisper_inputs,
        "audio",
    ),
]
