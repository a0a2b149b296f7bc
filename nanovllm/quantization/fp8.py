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

Every layout multiplies through `Fp8LinearMethod`, whose `route` picks the kernel for each call from
its rows, the scales' layout (per row or per row and group) and the device: the 16-bit GEMV for a
row (nanovllm/kernels/fp8_gemv.py), the Triton float8 GEMM transposed for decode batches (on Hopper
at 129-256 tokens the Gluon GEMM of nanovllm/kernels/fp8_gemm_hopper.py), or torch._scaled_mm / the
Triton GEMM on gemm_tile's tiles for larger ones (nanovllm/kernels/fp8_linear.py); the torch twins on
the CPU. The thresholds below say where each measurement put the switch.
"""
from typing import NamedTuple

import torch
from torch import nn

from nanovllm.kernels.fp8_gemm_hopper import HAS_GLUON, fp8_gemm_hopper, pays as hopper_gemm_pays
from nanovllm.kernels.fp8_gemv import fp8_gemv, sm_count
from nanovllm.kernels.fp8_linear import (MULTI_WAVE_TILE, GemmTile, block_scaled_mm_available, decode_tile,
                                         decode_waves, fp8_matmul, fp8_matmul_ref, quantize_activation,
                                         quantize_activation_ref, scaled_mm_blocks, scaled_mm_per_channel,
                                         two_piece_block_tile, two_piece_tile)
from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX, QuantizedActivation, dequantize_ref
from nanovllm.kernels.triton_compat import cuda_major_capability
from nanovllm.quantization.base import ModelShape, LinearMethod, QuantizationConfig, UnquantizedLinearMethod, shard_param

# a weight row of zeros still gets a usable scale
WEIGHT_SCALE_FLOOR = 1e-12

# Where a call's route switches (Fp8LinearMethod.route), as measured on one H100 with the Qwen3-8B
# projections (docs/benchmarks.md, quantized weights).

# At most this many 16-bit rows (no static input scale) skip the quantization and stream the weight
# through fp8_gemv (`scripts/int_gemm_bench.py --gemv`): at one row the four projections of 36 layers
# take 3.25 ms against 5.02 for the W8A8 path (per-channel; block 4.21 against 4.47); from two rows on
# the W8A8 path is as fast or faster.
GEMV_MAX_ROWS = 1
# Products of at most this many tokens (decode batches) run the Triton GEMM transposed, on
# decode_tile's tiles (a sweep of the 8B projections at 16-256 tokens, `scripts/int_gemm_bench.py --w8a8`).
SWAPPED_MAX_ROWS = 256
# Block scales at up to this many tokens keep gemm_tile's 16-token tile where decode_tile's grid takes
# several waves: gate_up_proj 28-29 us against 31-36 at 1-16 tokens; the other three projections
# take decode_tile (four projections x36 2.62-2.99 ms against 3.42-3.46, H200, 2026-12-03).
BLOCK_PLAIN_TILE_MAX_ROWS = 16
# Per-channel grids of several waves (gate_up, MULTI_WAVE_TILE) past this many tokens leave the
# transposed GEMM for _scaled_mm: cuBLASLt's row-wise GEMM wins there at 256 tokens, not at 192.
PER_CHANNEL_MULTI_WAVE_MAX_ROWS = 192
# Per-channel GEMMs on Hopper through torch._scaled_mm (True) or the Triton kernel (False). Measured
# on one H100 (Qwen3-8B projections, docs/benchmarks.md; the timing script is in git history):
# _scaled_mm is as fast or faster at most batch sizes (gate_up M=4096: 678 us against 754, bf16
# 1,191); bench.py with the 8B shape, online FP8 and FP8 KV: 10,998 tok/s with it, 9,967 with the
# Triton kernel.
SCALED_MM_PER_CHANNEL = True
# Block-scale products of at least this many tokens on Hopper go to cuBLASLt's block-scaled GEMM where
# torch has it (SCALED_MM_BLOCKS) and the scales come in whole 128 x 128 blocks. The 8B projections x36
# on one H200 (2026-12-04), cuBLASLt against the Triton kernel: 32 tokens 3.84 / 3.23 ms, 64 3.90 /
# 4.25, 128 3.91 / 6.28, 256 4.88 / 11.1, 16,384 181 / 864; bench.py with Qwen3-8B's block FP8
# weights and FP8 KV 12,336 tok/s from 65 tokens, 11,851 from 129, 6,335-6,505 without it.
BLOCK_SCALED_MM_MIN_ROWS = 64
SCALED_MM_BLOCKS = block_scaled_mm_available()
# Per-channel products of this many tokens on Hopper take the Gluon GEMM (fp8_gemm_hopper.py) where
# each of its programs keeps enough steps of K and, past 192 tokens, its tiles fit one wave
# (hopper_gemm_pays: qkv, gate_up, down at 129-192; qkv and down past): the 8B projections x36 at 144 /
# 192 tokens 3.14 / 3.25 ms against 3.28 / 3.82 on the transposed tiles, and bench.py (online FP8, FP8
# KV) 14,272 / 14,294 / 14,243 tok/s against 14,136 / 14,157 / 14,174 (H200, 2026-12-04). Past 192
# tokens its 64 x 256 tiles lost (14,443 against 14,522 tok/s); in 128 x 128 tiles, with the faster
# SiLU-and-quantize, bench.py gained 0.9% in each of two calls (14,645 / 14,614 against 14,490 / 14,521).
HOPPER_GEMM_ROWS = range(129, 257)


class CudaDevice(NamedTuple):
    """What a route reads of the GPU a call runs on."""
    sms: int
    major_capability: int       # 9: Hopper


def cuda_device(t: torch.Tensor) -> CudaDevice | None:
    """The GPU that holds t; None off CUDA."""
    return CudaDevice(sm_count(t.device), cuda_major_capability(t)) if t.is_cuda else None


class Fp8Route(NamedTuple):
    """The kernel that multiplies one call: "twin" (the torch twins: the CPU), "gemv" (fp8_gemv on the
    16-bit rows), "transposed" (fp8_matmul on `tile`), "hopper" (fp8_gemm_hopper), "scaled_mm"
    (torch._scaled_mm, row-wise scales), "scaled_mm_blocks" (torch's scaled_mm, 128 x 128 blocks) or
    "gemm" (fp8_matmul on gemm_tile's tile). All but the GEMV multiply float8 activations: x is
    quantized first, unless it comes quantized."""
    kernel: str
    tile: GemmTile | None = None


def quantizes_activation(x: torch.Tensor) -> bool:
    """Whether an FP8 layer with dynamic input scales quantizes x rather than sending it to the GEMV:
    always on the CPU, above GEMV_MAX_ROWS rows on CUDA. Where it does, the kernel that produces x
    (RMSNorm, SiLU-and-mul) may quantize it in its own pass instead."""
    return not x.is_cuda or x.shape[:-1].numel() > GEMV_MAX_ROWS


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous() if x.stride(-1) != 1 else x


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
    """What the float8 layouts share: each names its operands (the float8 weight [N, K], its scales
    [N, G] per row and group of `group_size` input columns, G = 1 for one scale a row, and a static
    input scale), and `route` picks the kernel that multiplies each call."""

    def operands(self, layer) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        raise NotImplementedError

    @staticmethod
    def route(rows: int, in_features: int, features: int, per_group: bool, dtype: torch.dtype,
              device: CudaDevice | None, raw_input: bool, whole_blocks: bool = False) -> Fp8Route:
        """The kernel for `rows` tokens of `dtype`, `in_features` wide, into `features` outputs, with
        scales per row and group (per_group) or per row, on `device` (None: off CUDA). Products of
        129-256 tokens take fp8_gemm_hopper with per-row scales on Hopper where it pays, else
        two_piece_tile's tile where it has one (two_piece_block_tile's, 129-160 tokens, with block
        scales). raw_input: x comes unquantized and without a static input scale, so the GEMV may
        read it as it is. whole_blocks: the scales are 128 x 128 blocks (per row, each of 128 rows
        repeating its block's) that cuBLASLt can take, from BLOCK_SCALED_MM_MIN_ROWS. The first rule
        that fits wins; the constants above say where each was measured."""
        if device is None:
            return Fp8Route("twin")
        if raw_input and rows <= GEMV_MAX_ROWS and dtype != torch.float32:
            return Fp8Route("gemv")
        if whole_blocks and SCALED_MM_BLOCKS and rows >= BLOCK_SCALED_MM_MIN_ROWS and \
                device.major_capability == 9 and dtype == torch.bfloat16:
            return Fp8Route("scaled_mm_blocks")
        if not per_group and rows in HOPPER_GEMM_ROWS and HAS_GLUON and device.major_capability == 9 and \
                in_features % 16 == 0 and hopper_gemm_pays(rows, features, in_features, device.sms):
            return Fp8Route("hopper")
        keeps_plain_tile = per_group and rows <= BLOCK_PLAIN_TILE_MAX_ROWS and decode_waves(features, device.sms) > 1
        if rows <= SWAPPED_MAX_ROWS and not keeps_plain_tile:
            two_pieces = two_piece_block_tile if per_group else two_piece_tile
            tile = two_pieces(rows, features, in_features, device.sms) or decode_tile(rows, features, device.sms)
            if per_group or tile != MULTI_WAVE_TILE or rows <= PER_CHANNEL_MULTI_WAVE_MAX_ROWS:
                return Fp8Route("transposed", tile)
        if not per_group and SCALED_MM_PER_CHANNEL and device.major_capability >= 9 and dtype == torch.bfloat16:
            return Fp8Route("scaled_mm")
        return Fp8Route("gemm")

    def route_of(self, x: torch.Tensor | QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor,
                 input_scale: torch.Tensor | None, whole_blocks: bool = False) -> Fp8Route:
        """`route` for x [M, K] (or a QuantizedActivation) times these operands."""
        quantized = isinstance(x, QuantizedActivation)
        rows = x.q if quantized else x
        return self.route(rows.shape[0], weight.shape[1], weight.shape[0], scale.shape[1] > 1, x.dtype,
                          cuda_device(rows), raw_input=not quantized and input_scale is None,
                          whole_blocks=whole_blocks)

    def multiply(self, x: torch.Tensor | QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor,
                 group_size: int, input_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, whole_blocks: bool = False) -> torch.Tensor:
        """x [..., K] 16/32-bit -> [..., N] in x's dtype by the route's kernel. x may come quantized
        already (a QuantizedActivation [M, K] in this layer's group size): then only the GEMM runs."""
        if isinstance(x, QuantizedActivation):
            return self.float8_product(self.route_of(x, weight, scale, input_scale, whole_blocks), x.q, x.scale,
                                       weight, scale, group_size, x.dtype, bias)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route = self.route_of(x, weight, scale, input_scale, whole_blocks)
        if route.kernel == "gemv":
            y = fp8_gemv(rows_contiguous(x), weight, scale, group_size, bias)
        else:
            if route.kernel == "twin":
                x_q, x_s = quantize_activation_ref(x, group_size, input_scale)
            else:
                x_q, x_s = quantize_activation(rows_contiguous(x), group_size, input_scale)
            y = self.float8_product(route, x_q, x_s, weight, scale, group_size, x.dtype, bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def float8_product(route: Fp8Route, x_q: torch.Tensor, x_s: torch.Tensor, weight: torch.Tensor,
                       scale: torch.Tensor, group_size: int, out_dtype: torch.dtype,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """The product of quantized activations on any route but the GEMV."""
        if route.kernel == "twin":
            return fp8_matmul_ref(x_q, x_s, weight, scale, group_size, out_dtype, bias)
        if route.kernel == "hopper":
            return fp8_gemm_hopper(x_q, x_s, weight, scale, out_dtype, bias)
        if route.kernel == "scaled_mm":
            return scaled_mm_per_channel(x_q, x_s, weight, scale, out_dtype, bias)
        if route.kernel == "scaled_mm_blocks":
            return scaled_mm_blocks(x_q, x_s, weight, scale, out_dtype, bias)
        return fp8_matmul(x_q, x_s, weight, scale, group_size, out_dtype, bias, route.tile)  # transposed or gemm

    def apply(self, layer, x, bias=None):
        return self.multiply(x, *self.operands(layer), bias=bias)

    def apply_silu_and_mul(self, layer, x, bias=None):
        # silu(gate) * up from the GEMV's epilogue where the GEMV takes x (and does not split K:
        # fp8_gemv then gives None), saving a launch and a round trip of gate and up per layer;
        # elsewhere the caller runs the layer and silu_and_mul apart
        weight, scale, group_size, input_scale = self.operands(layer)
        if isinstance(x, QuantizedActivation) or x.dim() != 2 or \
                self.route_of(x, weight, scale, input_scale).kernel != "gemv":
            return None
        return fp8_gemv(rows_contiguous(x), weight, scale, group_size, bias, gated=True)


def in_whole_blocks(block_size: tuple[int, int], input_start: int, input_size: int, output_sizes: list[int]) -> bool:
    """Whether a shard's block scales lie in whole 128 x 128 blocks that cuBLASLt can take: every part
    starting a block, and a row of block scales a multiple of 16 bytes (as in the shapes checked on an H200)."""
    return tuple(block_size) == (128, 128) and input_start % 128 == 0 and input_size % 512 == 0 \
        and all(size % 128 == 0 for size in output_sizes)


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
        layer.fp8_whole_blocks = in_whole_blocks((self.block_n, self.block_k), start, input_size, output_sizes)

    def operands(self, layer):
        return layer.weight, layer.weight_scale_inv, layer.fp8_group_size, None

    def apply(self, layer, x, bias=None):
        return self.multiply(x, *self.operands(layer), bias=bias, whole_blocks=layer.fp8_whole_blocks)

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
