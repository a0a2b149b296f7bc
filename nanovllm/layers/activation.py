"""SwiGLU activation over the merged gate/up projection.

When the layer it feeds is an FP8 layer that quantizes its input per token (or per token and group),
the model sets `quant_group_size` and the activation comes out quantized (a QuantizedActivation),
wherever the layer would quantize it (`quantizes_activation` in nanovllm/quantization/fp8.py).
"""
import torch
from torch import nn

from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_quant, silu_and_mul_quant_ref, silu_and_mul_ref
from nanovllm.quantization.fp8 import quantizes_activation


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant_group_size: int | None = None     # None: a 16-bit output

    def forward(self, x: torch.Tensor):
        if self.quant_group_size is not None and quantizes_activation(x):
            quantize = silu_and_mul_quant if x.is_cuda else silu_and_mul_quant_ref
            return quantize(x, self.quant_group_size)
        return silu_and_mul(x) if x.is_cuda else silu_and_mul_ref(x)
