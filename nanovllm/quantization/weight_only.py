"""What AWQ and GPTQ share: integer weights with a scale and zero per group of input rows, turned
once after loading into the layout of nanovllm/kernels/int_gemm.py and multiplied there (on the
GPU, 16-bit activations; 4 bits by nanovllm/kernels/int4_gemv.py up to 16 rows and
nanovllm/kernels/int4_gemm.py below DEQUANTIZE_FROM_ROWS, on Hopper from 2 rows its Gluon twin
nanovllm/kernels/int4_gemm_hopper.py; prefills by cuBLAS on the weight dequantized
by nanovllm/kernels/int_dequantize.py) or by its torch twin (on the CPU, and for float32).
Activations stay unquantized: weight-only quantization.
"""
import torch
from torch import nn

from nanovllm.kernels import int4_gemv as int4_gemv_module
from nanovllm.kernels.int4_gemm import gemm_supported, int4_gemm
from nanovllm.kernels.int4_gemm_hopper import int4_gemm_hopper, takes as hopper_gemm_takes
from nanovllm.kernels.int4_gemv import gemv_supported, int4_gemv
from nanovllm.kernels.int_dequantize import DEQUANTIZE_FROM_ROWS, dequantized_matmul
from nanovllm.kernels.int_gemm import int_gemm, int_gemm_ref
from nanovllm.quantization.base import LinearMethod


def runs_kernels(x: torch.Tensor) -> bool:
    """16-bit activations on the GPU take the Triton kernels; the CPU and float32 take the twin."""
    return x.is_cuda and x.dtype != torch.float32


class WeightOnlyIntMethod(LinearMethod):
    """A subclass creates its format's parameters and says how they become the GEMM's layout."""

    def __init__(self, bits: int):
        self.bits = bits

    def gemm_layout(self, layer: nn.Module) -> tuple[dict[str, torch.Tensor], int, torch.Tensor | None]:
        """The loaded tensors -> ({qweight, scales, scaled_zeros} in the GEMM's layout and the
        model's dtype, rows per group, per-row group index or None when groups are runs of rows)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed, group_size, g_idx = self.gemm_layout(layer)
        for name, _ in list(layer.named_parameters(recurse=False)):
            if name != "bias":
                delattr(layer, name)
        for name, tensor in packed.items():
            setattr(layer, name, nn.Parameter(tensor.contiguous(), requires_grad=False))
        layer.g_idx = None if g_idx is None else nn.Parameter(g_idx.to(torch.int32).contiguous(), requires_grad=False)
        layer.group_size = group_size

    def takes_gemv(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether x [M, K] goes through the 4-bit GEMV: 16-bit rows on the GPU, a few of them, that
        Hopper's GEMM does not take (on Hopper, one row)."""
        return runs_kernels(x) and x.shape[0] <= int4_gemv_module.GEMV_MAX_ROWS \
            and gemv_supported(x.shape[1], layer.group_size, layer.g_idx, self.bits) and not hopper_gemm_takes(x)

    def takes_gemm(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether x [M, K] goes through the 4-bit GEMM of decode batches: 16-bit rows on the GPU, fewer
        than DEQUANTIZE_FROM_ROWS (more, as in prefills, multiply the dequantized weight)."""
        return runs_kernels(x) and x.shape[0] < DEQUANTIZE_FROM_ROWS \
            and gemm_supported(x.shape[1], layer.group_size, layer.g_idx, self.bits)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        args = (layer.qweight, layer.scales, layer.scaled_zeros)
        if not runs_kernels(x2):
            y = int_gemm_ref(x2, *args, self.bits, layer.group_size, layer.g_idx)
        elif self.takes_gemv(layer, x2):
            # a layer feeding a residual norm (RowParallelLinear.feed_residual_norm) may hand it
            # unfinished split-K sums as they are; a 2-D output needs no reshape
            leave_sums = getattr(layer, "leaves_sums_to_norm", False) and bias is None and x.dim() == 2
            y = int4_gemv(x2, *args, layer.group_size, leave_sums=leave_sums)
            if leave_sums:
                return y
        elif self.takes_gemm(layer, x2):
            y = (int4_gemm_hopper if hopper_gemm_takes(x2) else int4_gemm)(x2, *args, layer.group_size)
        else:   # prefills of every format through the dequantized weight; the rest through int_gemm
            multiply = dequantized_matmul if x2.shape[0] >= DEQUANTIZE_FROM_ROWS else int_gemm
            y = multiply(x2, *args, self.bits, layer.group_size, layer.g_idx)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def apply_silu_and_mul(self, layer, x, bias=None):
        # the GEMV's epilogue; a bias would have to be added before the activation
        if bias is not None or x.dim() != 2 or not self.takes_gemv(layer, x):
            return None
        return int4_gemv(x.contiguous(), layer.qweight, layer.scales, layer.scaled_zeros, layer.group_size,
                         gated=True)


def linear_shapes(model_config, tensor_parallel_size: int) -> dict[str, tuple[int, list[int]]]:
    """Each linear layer kind of a dense decoder layer -> (input features, output features of each
    part) on one rank, as nanovllm/layers/linear.py splits them."""
    c, tp = model_config, tensor_parallel_size
    q, kv = c.num_heads // tp * c.head_dim, max(1, c.num_kv_heads // tp) * c.head_dim
    return {"qkv_proj": (c.hidden_size, [q, kv, kv]), "o_proj": (c.num_heads * c.head_dim // tp, [c.hidden_size]),
            "gate_up_proj": (c.hidden_size, [c.intermediate_size // tp] * 2),
            "down_proj": (c.intermediate_size // tp, [c.hidden_size])}


def check_groups(method: str, model_config, tensor_parallel_size: int, group_size: int, columns_per_word: int) -> None:
    """ValueError naming `quantization` when a layer's input rows (on one rank) are not whole groups
    or its output parts are not whole packed words; also for experts, which these formats do not cover here."""
    if model_config.num_experts:
        raise ValueError(f"quantization: {method} checkpoints of mixture-of-experts models are not supported")
    for name, (inputs, outputs) in linear_shapes(model_config, tensor_parallel_size).items():
        if group_size != -1 and inputs % group_size:
            raise ValueError(f"quantization: {method} group_size={group_size} does not divide the {inputs} input "
                             f"features of {name}" + (f" on each of {tensor_parallel_size} ranks"
                                                      if tensor_parallel_size > 1 else ""))
        if any(size % columns_per_word for size in outputs):
            raise ValueError(f"quantization: {method} packs {columns_per_word} columns per int32, which does not "
                             f"divide the output features {outputs} of {name}"
                             + (f" on each of {tensor_parallel_size} ranks" if tensor_parallel_size > 1 else ""))
