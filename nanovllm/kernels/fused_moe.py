"""A mixture-of-experts feed-forward pass: every token goes through its top-k experts' SwiGLU MLPs and
the results are summed with the routing weights.

The kernel path groups the work by expert so that each expert's weights are read once per tile of
tokens, not once per token:
1. `align_tokens_to_experts` (moe_routing.py) groups the (token, k) assignments by expert and pads
   each expert's group to a multiple of the tile height, so no tile mixes two experts.
2. A grouped GEMM over the stacked gate/up weights w13 [E, 2 * I, H] with SiLU-and-mul in its
   epilogue gives each assignment's activation [I].
3. A grouped GEMM over the stacked down weights w2 [E, H, I] scales each row by its routing weight;
   the top-k rows of a token are then summed (`sum_top_k`).

Experts stored in float8 (Qwen3-MoE FP8 checkpoints) come as an object with `weight` [E, N, K]
float8, `scale` [E, N, G] float32 (one per row and group of `group_size` input columns) and, for the
twin, indexing that dequantizes one expert: the kernels read the float8 bytes and dequantize each
weight tile in registers, so a step reads half the bytes of 16-bit experts.

`fused_moe_ref` is the torch twin (a loop over the experts that got tokens); it is also the CPU path.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.kernels.moe_routing import align_tokens_to_experts
from nanovllm.kernels.triton_compat import pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2 * I, H] (gate rows, then up rows); w2: [E, H, I];
    topk_weights, topk_ids: [T, K]. Returns [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out


@dataclass(frozen=True, slots=True)
class MoeTile:
    block_m: int      # assignments per tile (each tile belongs to one expert)
    block_n: int      # output features per tile
    block_k: int      # reduction step
    num_warps: int = 4
    num_stages: int = 3


# Decode: a few tokens per expert, so short tiles (16 is tl.dot's minimum) that waste little padding
# and wide reduction steps to keep weight reads in flight. Prefill: tall tiles that reuse each
# weight tile over many tokens.
DECODE_TILE = MoeTile(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL_TILE = MoeTile(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def choose_tile(num_tokens: int, top_k: int, num_experts: int) -> MoeTile:
    """The decode tile while an expert gets at most one short tile of assignments on average."""
    return DECODE_TILE if num_tokens * top_k <= DECODE_TILE.block_m * num_experts else PREFILL_TILE


@triton.jit
def _dequantized(w, scale_ptrs, group, mask_n, W_FP8: tl.constexpr, dtype: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile as the activations' dtype: float8 times its rows' scales
    of the tile's group (BLOCK_K divides the group size)."""
    if W_FP8:     # (one return: Triton types both returns of a function, whatever the constexpr)
        scales = tl.load(scale_ptrs + group, mask=mask_n, other=0.0)
        w = (w.to(tl.float32) * scales[None, :]).to(dtype)
    return w


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, w_scale_ptr, out_ptr, topk_weights_ptr, sorted_token_ids_ptr,
                         expert_ids_ptr, num_tokens_post_padded_ptr, num_assignments, N, K,
                         stride_a_row, stride_w_expert, stride_w_n, stride_s_expert, stride_s_n, stride_out_row,
                         ASSIGNMENTS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                         W_FP8: tl.constexpr, GROUP_SIZE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    """out[i, :N] = f(a[i // ASSIGNMENTS_PER_A_ROW] @ w[expert(i)]^T) for the assignments i of one tile.
    GATED: w holds N gate rows then N up rows and f is silu(gate) * up. WEIGHTED: f scales by the
    routing weight of assignment i. W_FP8: w is float8 with scales per row and GROUP_SIZE columns."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m, tile_n = pid // num_tiles_n, pid % num_tiles_n
    if tile_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + tile_m).to(tl.int64)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_token_ids_ptr + offs_m)
    valid = assignment < num_assignments                    # padding rows compute nothing and store nothing
    a_row = tl.where(valid, assignment // ASSIGNMENTS_PER_A_ROW, 0).to(tl.int64)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_a_row + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_w_expert + offs_n[None, :] * stride_w_n + offs_k[:, None]
    scale_ptrs = w_scale_ptr + expert * stride_s_expert + offs_n * stride_s_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - k * BLOCK_K
        group = k * BLOCK_K // GROUP_SIZE
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        w = _dequantized(w, scale_ptrs, group, mask_n, W_FP8, a.dtype)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_w_n, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            w_up = _dequantized(w_up, scale_ptrs + N * stride_s_n, group, mask_n, W_FP8, a.dtype)
            acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(topk_weights_ptr + assignment, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + assignment.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def _grouped_gemm(a: torch.Tensor, w, out: torch.Tensor, topk_weights: torch.Tensor,
                  alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor], assignments_per_a_row: int,
                  gated: bool, tile: MoeTile) -> None:
    sorted_token_ids, expert_ids, num_tokens_post_padded = alignment
    weight, scale, group_size = (w, w, 1) if isinstance(w, torch.Tensor) else (w.weight, w.scale, w.group_size)
    block_k = math.gcd(tile.block_k, group_size) if scale is not weight else tile.block_k   # one group a step
    if block_k < 16:     # a rank's slice inside one scale block, of odd width: read it dequantized
        weight = scale = torch.stack([w[expert] for expert in range(len(weight))])
        block_k = tile.block_k
    fp8 = scale is not weight
    n = out.shape[1]
    grid = (len(expert_ids) * triton.cdiv(n, tile.block_n),)
    _grouped_gemm_kernel[grid](
        a, weight, scale, out, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        topk_weights.numel(), n, a.shape[1], a.stride(0), weight.stride(0), weight.stride(1),
        scale.stride(0), scale.stride(1), out.stride(0),
        ASSIGNMENTS_PER_A_ROW=assignments_per_a_row, GATED=gated, WEIGHTED=not gated, W_FP8=fp8,
        GROUP_SIZE=group_size, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_launch(a))


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tile: MoeTile | None = None) -> torch.Tensor:
    """The kernel path of fused_moe_ref (same arguments; w13 and w2 16-bit tensors or float8
    experts, see the top of this file); `tile` overrides the size-based choice."""
    num_tokens, hidden = x.shape
    w13_weight, w2_weight = (getattr(w, "weight", w) for w in (w13, w2))
    num_experts, two_i, _ = w13_weight.shape
    top_k = topk_ids.shape[1]
    assert x.stride(1) == 1 and w13_weight.is_contiguous() and w2_weight.is_contiguous()
    assert w2_weight.shape == (num_experts, hidden, two_i // 2)
    tile = tile or choose_tile(num_tokens, top_k, num_experts)
    alignment = align_tokens_to_experts(topk_ids, tile.block_m, num_experts)
    topk_weights = topk_weights.contiguous()
    # one row per (token, k) assignment, in assignment order; every row is written exactly once
    activation = torch.empty(num_tokens * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, activation, topk_weights, alignment, top_k, gated=True, tile=tile)
    expert_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(activation, w2, expert_out, topk_weights, alignment, 1, gated=False, tile=tile)
    return sum_top_k(expert_out.view(num_tokens, top_k, hidden))


@triton.jit
def _sum_top_k_kernel(x_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (token * TOP_K + k) * H + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def sum_top_k(expert_out: torch.Tensor) -> torch.Tensor:
    """[T, K, H] contiguous -> [T, H]: each token's K expert outputs summed in float32, in order
    (torch's sum over the middle dimension took 4.7 us a layer at batch 1 on one H100, this 1.7)."""
    num_tokens, top_k, hidden = expert_out.shape
    out = torch.empty(num_tokens, hidden, dtype=expert_out.dtype, device=expert_out.device)
    if num_tokens:
        block_h = min(1024, triton.next_power_of_2(hidden))
        _sum_top_k_kernel[(num_tokens, triton.cdiv(hidden, block_h))](expert_out, out, hidden, TOP_K=top_k,
                                                                      BLOCK_H=block_h, **pdl_launch(expert_out))
    return out
