"""The facts about a model that the engine needs, read once from its Hugging Face config.

Configs differ by family and by transformers version (rope_theta at the top level or inside
rope_parameters; torch_dtype or dtype; head_dim given or implied); everything past this file reads
one `ModelConfig` instead. The family-specific facts (q/k norms, q/k/v biases, rope scaling types)
come from the family class the registry picks, so this file imports no model.
"""
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str              # architectures[0] of config.json, the registry key
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None      # rope_type and its parameters; None for plain rotary
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool                  # RMSNorm on each query and key head before rotary
    dtype: torch.dtype             # of the checkpoint
    sliding_window: int | None     # None: every layer attends to the whole context
    # mixture of experts; the defaults describe a dense family
    num_experts: int | None = None            # experts per sparse layer
    num_experts_per_tok: int | None = None    # top-k experts each token goes through
    moe_intermediate_size: int | None = None  # each expert's intermediate size
    norm_topk_prob: bool = False              # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1              # every n-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()     # ... except these, which keep the dense MLP

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig, family: type) -> "ModelConfig":
        """`family`: the CausalLM subclass named by architectures[0] (its qk_norm, qkv_bias and
        rope_types). Raises ValueError for an activation or rope scaling the engine cannot run."""
        architecture = hf_config.architectures[0]
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model: hidden_act {act!r} is not supported; supported: ['silu']")
        theta, rope_scaling = read_rope(hf_config)
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type not in family.rope_types:
            raise ValueError(f"model: rope scaling type {rope_type!r} is not supported for {architecture}; "
                             f"supported: {list(family.rope_types)}")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        heads = hf_config.num_attention_heads
        return cls(
            architecture=architecture,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=family.qk_norm,
            dtype=read_checkpoint_dtype(hf_config),
            sliding_window=read_sliding_window(hf_config),
            **read_experts(hf_config),
        )


def read_rope(hf_config: PretrainedConfig) -> tuple[float, dict | None]:
    """(rope_theta, scaling). transformers 5 keeps both in rope_parameters; older configs have
    rope_theta at the top level and the scaling in rope_scaling, whose type key was once `type`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("model: config.json has neither rope_theta nor rope_parameters.rope_theta")
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    return float(theta), (None if rope_type == "default" else {"rope_type": rope_type, **params})


def read_checkpoint_dtype(hf_config: PretrainedConfig) -> torch.dtype:
    """transformers 5 calls it dtype, older configs torch_dtype; bfloat16 when neither says."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"model: checkpoint dtype {dtype!r} is not one of {sorted(CHECKPOINT_DTYPES)}")
        return CHECKPOINT_DTYPES[dtype]
    return dtype


def read_sliding_window(hf_config: PretrainedConfig) -> int | None:
    """The window when some layer uses one. Configs that can switch it off (use_sliding_window,
    layer_types) already report None, or name the layers that slide, once transformers reads them."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def read_experts(hf_config: PretrainedConfig) -> dict:
    """The mixture-of-experts fields of a config that has experts; nothing (the defaults) otherwise."""
    num_experts = getattr(hf_config, "num_experts", None)
    if not num_experts:
        return {}
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        moe_intermediate_size=int(hf_config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        decoder_sparse_step=int(getattr(hf_config, "decoder_sparse_step", None) or 1),
        mlp_only_layers=tuple(getattr(hf_config, "mlp_only_layers", None) or ()),
    )
