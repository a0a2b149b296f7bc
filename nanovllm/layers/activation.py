"""SwiGLU activation over the merged gate/up projection."""
import torch
from torch import nn

from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if x.is_cuda else silu_and_mul_ref(x)
