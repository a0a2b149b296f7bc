"""`quant_method: "fp8"`: float8 e4m3 weights, activations quantized to float8 at run time.

Three layouts (the names and shapes of vLLM's vllm/model_executor/layers/quantization/fp8.py,
which also reads Qwen3-*-FP8 and DeepSeek-V3):
- block (`weight_block_size: [bn, bk]`, Qwen3-*-FP8: [128, 128]): `weight` float8_e4m3fn [out, in]
  and `weight_scale_inv` float32 [ceil(out / bn), ceil(in / bk)] (despite the name, the factor
  that multiplies the stored weight); activations dynamic per token and bk-column group. The
  scales are kept per output row (each row repeats its block's scales, +1/bn of the weight's
  bytes in float32), so any split of the output features under tensor parallelism or a merged
  q/k/v or gate/up matrix loads with them; the input features of a rank must start at a block
  boundary or lie within one block.
- per tensor (no block size): `weight` float8 and a scalar `weight_scale`, optionally a scalar
  `input_scale` (`activation_scheme: "static"`); merged matrices keep each part's scale (folded
  into a per-row scale after loading).
- online (`quantization="fp8"` on a 16-bit checkpoint): each weight is quantized after loading with
  one scale per output row (max |w| / 448), activations dynamic per token.
`ignored_layers` (vLLM) or `modules_to_not_convert` (transformers) stay 16-bit.
Qwen3-MoE experts in block layout (`experts.N.gate_proj.weight` + `weight_scale_inv`) load into
stacked float8 weights with per-row block scales (`Fp8BlockMoEMethod`).
"""
import torch
from torch import nn

from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX
from nanovllm.kernels.fp8_linear import dequantize_ref, fp8_linear, fp8_linear_silu_and_mul
from nanovllm.quantization.base import ModelShape, LinearMethod, QuantizationConfig, UnquantizedLinearMethod, shard_param

# a weight row of zeros still gets a usable scale
WEIGHT_SCALE_FLOOR = 1e-12


def input_group_size(input_size: int, input_start: int, block_k: int, what: str) -> int:
    """Columns per activation group of a rank's input slice [input_start, input_start + input_size)
    whose weight has one scale per block_k global columns: block_k when the slice starts on a
    block boundary, the whole slice when it lies inside one block."""
    if input_start % block_k == 0:
        return block_k
    if input_start // block_k == (input_start + input_size - 1) // block_k:
        return input_size
    raise ValueError(f"quantization: fp8 weight_block_size {block_k} does not divide {what}: this rank's input "
                     f"features [{input_start}, {input_start + input_size}) cross a block boundary; use a "
                     f"tensor_parallel_size that splits the input at multiples of {block_k}")


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, serialized: bool, activation_scheme: str = "dynamic",
                 weight_block_size: tuple[int, int] | None = None, skipped_modules=()):
        super().__init__(skipped_modules)
        self.serialized = serialized     # float8 in the checkpoint; False: quantized while loading
        self.activation_scheme = activation_scheme
        self.weight_block_size = weight_block_size

    @classmethod
    def from_config(cls, quantization_config: dict) -> "Fp8Config":
        scheme = quantization_config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization: fp8 activation_scheme {scheme!r} is not 'dynamic' or 'static'")
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization: fp8 fmt {fmt!r} is not supported; supported: ['e4m3']")
        block = quantization_config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or not all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block):
                raise ValueError(f"quantization: fp8 weight_block_size must be two powers of two >= 16, got {block!r}")
            if scheme != "dynamic":
                raise ValueError("quantization: fp8 weight_block_size needs activation_scheme 'dynamic'")
            block = tuple(block)
        skipped = quantization_config.get("ignored_layers") or quantization_config.get("modules_to_not_convert") or ()
        return cls(True, scheme, block, skipped)

    @classmethod
    def online(cls) -> "Fp8Config":
        return cls(serialized=False)

    def describe(self) -> str:
        if not self.serialized:
            return "fp8 per-channel, quantized while loading"
        if self.weight_block_size:
            return f"fp8 block {self.weight_block_size[0]}x{self.weight_block_size[1]}"
        return f"fp8 per-tensor, {self.activation_scheme} activations"

    def verify(self, model_config: ModelShape, tensor_parallel_size: int) -> None:
        if not self.weight_block_size:
            return
        block_k, tp = self.weight_block_size[1], tensor_parallel_size
        split_inputs = {"o_proj": model_config.num_heads * model_config.head_dim,
                        "down_proj": model_config.intermediate_size}
        if model_config.moe_intermediate_size:
            split_inputs["experts' down_proj"] = model_config.moe_intermediate_size
        for what, size in split_inputs.items():
            for rank in range(tp):
                input_group_size(size // tp, rank * size // tp, block_k, f"{what} ({size} input features / tp={tp})")

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        if not self.serialized:
            return Fp8OnlineLinearMethod()
        if self.weight_block_size:
            return Fp8BlockLinearMethod(self.weight_block_size)
        return Fp8TensorLinearMethod(static_input=self.activation_scheme == "static")

    def moe_method(self, layer: nn.Module, prefix: str):
        if not self.serialized:
            return None     # online quantization leaves the experts 16-bit
        if not self.weight_block_size:
            raise ValueError("quantization: fp8 experts are read in the block layout (weight_block_size) only")
        return Fp8BlockMoEMethod(self.weight_block_size)


def fp8_weight(output_size: int, input_size: int) -> nn.Parameter:
    return shard_param(torch.empty(output_size, input_size, dtype=FP8_DTYPE), output_dim=0, input_dim=1)


class Fp8LinearMethod(LinearMethod):
    """What the float8 layouts share: each names its operands for fp8_linear (the float8 weight,
    its scales in fp8_linear's layout, the group size those scales cover, a static input scale)."""

    def operands(self, layer) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        raise NotImplementedError

    def apply(self, layer, x, bias=None):
        weight, scale, group_size, input_scale = self.operands(layer)
        return fp8_linear(x, weight, scale, group_size, input_scale=input_scale, bias=bias)

    def apply_silu_and_mul(self, layer, x, bias=None):
        return fp8_linear_silu_and_mul(x, *self.operands(layer), bias=bias)


class Fp8BlockLinearMethod(Fp8LinearMethod):
    def __init__(self, block_size: tuple[int, int]):
        self.block_n, self.block_k = block_size

    def create_weights(self, layer, input_size, output_sizes, dtype):
        start = layer.input_start
        layer.fp8_group_size = input_group_size(input_size, start, self.block_k, f"layer input ({input_size} features)")
        blocks = -(-(start + input_size) // self.block_k) - start // self.block_k
        layer.weight = fp8_weight(sum(output_sizes), input_size)
        layer.weight_scale_inv = shard_param(torch.empty(sum(output_sizes), blocks, dtype=torch.float32),
                                             output_dim=0, input_dim=1, units={1: self.block_k},
                                             checkpoint_units={0: self.block_n, 1: self.block_k})

    def operands(self, layer):
        return layer.weight, layer.weight_scale_inv, layer.fp8_group_size, None

    def fused_input_group_size(self, layer):
        return layer.fp8_group_size


class Fp8TensorLinearMethod(Fp8LinearMethod):
    """One scale per checkpoint tensor (per part of a merged matrix), folded into per-row scales."""

    def __init__(self, static_input: bool):
        self.static_input = static_input

    def create_weights(self, layer, input_size, output_sizes, dtype):
        layer.weight = fp8_weight(sum(output_sizes), input_size)
        layer.weight_scale = shard_param(torch.empty(len(output_sizes), dtype=torch.float32), per_shard=True)
        if self.static_input:
            layer.input_scale = shard_param(torch.empty(len(output_sizes), dtype=torch.float32), per_shard=True)

    def process_weights_after_loading(self, layer):
        sizes = torch.tensor(layer.output_sizes, device=layer.weight_scale.device)
        per_row = layer.weight_scale.data.repeat_interleave(sizes).reshape(-1, 1)
        layer.weight_scale = nn.Parameter(per_row, requires_grad=False)
        if self.static_input:   # one scale for the merged input: the parts' largest clips nothing
            layer.input_scale = nn.Parameter(layer.input_scale.data.amax().reshape(1), requires_grad=False)

    def operands(self, layer):
        return layer.weight, layer.weight_scale, layer.input_size, layer.input_scale if self.static_input else None

    def fused_input_group_size(self, layer):
        return None if self.static_input else layer.input_size


class Fp8ChannelLinearMethod(Fp8LinearMethod):
    """One scale per output row, `weight_scale` [out, 1] (compressed-tensors' channel strategy)."""

    def create_weights(self, layer, input_size, output_sizes, dtype):
        layer.weight = fp8_weight(sum(output_sizes), input_size)
        layer.weight_scale = shard_param(torch.empty(sum(output_sizes), 1, dtype=torch.float32), output_dim=0)

    def operands(self, layer):
        return layer.weight, layer.weight_scale, layer.input_size, None

    def fused_input_group_size(self, layer):
        return layer.input_size


def quantize_weight_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scales [N, 1]): each row's max |w| maps to 448."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(WEIGHT_SCALE_FLOOR)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8OnlineLinearMethod(Fp8ChannelLinearMethod):
    """Loads the 16-bit weight, then keeps it as float8 with per-row scales."""

    def create_weights(self, layer, input_size, output_sizes, dtype):
        UnquantizedLinearMethod().create_weights(layer, input_size, output_sizes, dtype)

    def process_weights_after_loading(self, layer):
        weight, scale = quantize_weight_per_row(layer.weight.data)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)


class Fp8Experts:
    """Stacked float8 experts with their scales, as the fused MoE kernels read them; indexing gives
    one expert dequantized to 16/32 bits (the torch twin's path)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype):
        self.weight, self.scale, self.group_size, self.dtype = weight, scale, group_size, dtype

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_ref(self.weight[expert], self.scale[expert], self.group_size).to(self.dtype)


class Fp8BlockMoEMethod:
    """Stacked experts w13 [E, 2 * I, H] and w2 [E, H, I] in float8 with per-row block scales."""

    def __init__(self, block_size: tuple[int, int]):
        self.block_n, self.block_k = block_size

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_per_rank: int,
                       dtype: torch.dtype) -> None:
        start = layer.tp_rank * intermediate_per_rank
        layer.w2_group_size = input_group_size(intermediate_per_rank, start, self.block_k, "the experts' down_proj")
        layer.w13_group_size = self.block_k
        for name, rows, cols, col_start, group in (
                ("w13", 2 * intermediate_per_rank, hidden_size, 0, layer.w13_group_size),
                ("w2", hidden_size, intermediate_per_rank, start, layer.w2_group_size)):
            blocks = -(-(col_start + cols) // self.block_k) - col_start // self.block_k
            setattr(layer, f"{name}_weight", shard_param(torch.empty(num_experts, rows, cols, dtype=FP8_DTYPE),
                                                         output_dim=0, input_dim=1))
            setattr(layer, f"{name}_weight_scale_inv", shard_param(
                torch.empty(num_experts, rows, blocks, dtype=torch.float32), output_dim=0, input_dim=1,
                units={1: self.block_k}, checkpoint_units={0: self.block_n, 1: self.block_k}))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def expert_weights(self, layer: nn.Module, dtype: torch.dtype) -> tuple[Fp8Experts, Fp8Experts]:
        return (Fp8Experts(layer.w13_weight, layer.w13_weight_scale_inv, layer.w13_group_size, dtype),
                Fp8Experts(layer.w2_weight, layer.w2_weight_scale_inv, layer.w2_group_size, dtype))
