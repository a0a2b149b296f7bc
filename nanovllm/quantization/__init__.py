"""Quantized weights: the formats the engine reads, keyed by config.json's `quantization_config.quant_method`.

A format's module is imported only when a checkpoint asks for it. The interface every format
implements is in nanovllm/quantization/base.py.
"""
import importlib

from nanovllm.quantization.base import QuantizationConfig

# quant_method -> "module:class" of its QuantizationConfig
QUANTIZATION_METHODS = {
    "fp8": "nanovllm.quantization.fp8:Fp8Config",
    "compressed-tensors": "nanovllm.quantization.compressed_tensors:CompressedTensorsConfig",
    "awq": "nanovllm.quantization.awq:AWQConfig",
    "gptq": "nanovllm.quantization.gptq:GPTQConfig",
}
# methods that quantize a 16-bit checkpoint while loading it (`quantization=` on an unquantized model)
ONLINE_METHODS = ("fp8",)


def config_class(method: str) -> type[QuantizationConfig]:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: method {method!r} is not supported; supported: {sorted(QUANTIZATION_METHODS)}")
    module, name = QUANTIZATION_METHODS[method].split(":")
    return getattr(importlib.import_module(module), name)


def read_quantization(checkpoint_config: dict | None, quantization: str | None) -> QuantizationConfig | None:
    """The quantization of a model: the checkpoint's `quantization_config` (dict or None) and the
    `quantization` engine argument must agree; an argument alone quantizes a 16-bit checkpoint
    while loading (online). None: 16-bit weights."""
    if quantization is not None and not isinstance(quantization, str):
        raise TypeError(f"quantization must be a string or None, got {quantization!r}")
    if checkpoint_config is None:
        if quantization is None:
            return None
        if quantization not in ONLINE_METHODS:
            config_class(quantization)   # unknown methods are named first
            raise ValueError(f"quantization={quantization!r} needs a checkpoint quantized that way; a 16-bit "
                             f"checkpoint can be quantized while loading only with {list(ONLINE_METHODS)}")
        return config_class(quantization).online()
    if not isinstance(checkpoint_config, dict):
        checkpoint_config = checkpoint_config.to_dict()   # transformers may keep it as an object
    method = checkpoint_config.get("quant_method")
    if method is None:
        raise ValueError("quantization: config.json's quantization_config has no 'quant_method'")
    method = str(method).lower()
    if quantization is not None and quantization != method:
        raise ValueError(f"quantization={quantization!r} disagrees with the checkpoint, whose "
                         f"quantization_config.quant_method is {method!r}; pass quantization={method!r} or None")
    return config_class(method).from_config(checkpoint_config)


def random_weights_config(method: str) -> dict | None:
    """quantization_config for random weights of a 16-bit shape in checkpoint format `method`
    (load_format "dummy"); None for methods that quantize online."""
    return config_class(method).random_weights_config()
