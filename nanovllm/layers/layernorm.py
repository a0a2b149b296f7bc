"""RMSNorm; given a residual it adds it first and returns the new residual too.

When the layer it feeds is an FP8 layer that quantizes its input per token (or per token and group),
the model sets `quant_group_size` and the norm writes that input quantized (a QuantizedActivation)
in its own pass, wherever the layer would quantize it (`quantizes_activation` in nanovllm/quantization/fp8.py).

With a residual, the input may be a linear layer's unfinished split-K sums (PendingSums, see
RowParallelLinear.feed_residual_norm): the norm's kernel finishes them.
"""
import torch
from torch import nn

from nanovllm.kernels.rms_norm import rms_norm, rms_norm_quant, rms_norm_quant_ref, rms_norm_ref
from nanovllm.kernels.zeroed_workspace import PendingSums
from nanovllm.quantization.fp8 import quantizes_activation


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.quant_group_size: int | None = None     # None: a 16-bit output

    def forward(self, x: torch.Tensor | PendingSums, residual: torch.Tensor | None = None):
        if isinstance(x, PendingSums):
            return rms_norm(x, self.weight, self.eps, residual)
        if self.quant_group_size is not None and quantizes_activation(x):
            norm = rms_norm_quant if x.is_cuda else rms_norm_quant_ref
            return norm(x, self.weight, self.eps, self.quant_group_size, residual)
        norm = rms_norm if x.is_cuda else rms_norm_ref
        return norm(x, self.weight, self.eps, residual)
