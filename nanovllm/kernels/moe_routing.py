"""A mixture of experts' routing in two kernels: each token's top-k experts, then the assignments
grouped by expert for the grouped GEMMs.

In torch the two steps take about twenty small kernels a layer (softmax, top-k's sorts, a
histogram, cumsums, an argsort, gathers and scatters, a searchsorted): at decode they cost more than
the experts' GEMMs (Qwen3-30B-A3B at batch 1 on one H100: ~45 us a layer against ~25). Here:
- `route`: one program per block of tokens takes the softmax over the experts in float32, picks the
  top-k by repeated maximum (the lowest index among equal probabilities), renormalises them when
  asked and writes them in the activations' dtype.
- `align_tokens_to_experts`: one program counts the assignments per expert, lays out each expert's
  group padded to a multiple of the tile height, and writes every assignment at its place (by a
  running count per expert, so each group keeps token order, as the stable argsort of the twin
  does), then each tile's expert. One program serves decode batches; larger ones (prefill) take the
  torch twin, whose sort scales with the assignments.
`route_ref` and `align_tokens_to_experts_ref` are the torch twins (and the CPU path).
"""
import torch

from nanovllm.kernels.triton_compat import pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel

# Up to this many (token, expert) assignments the one-program kernel groups them (decode: 512
# tokens of top-8); beyond, the twin's sort.
ALIGN_KERNEL_MAX_ASSIGNMENTS = 4096


def route_ref(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the top-k of it, renormalised to sum to 1 when asked, then
    rounded to `dtype` (the reference rounds the routing weights to the activations' dtype).
    Returns (weights [T, K] dtype, expert ids [T, K] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, stride_logits, NUM_EXPERTS: tl.constexpr,
                  BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    rows = tl.minimum(tokens, num_tokens - 1)      # past the last token: its row again, not stored
    logits = tl.load(logits_ptr + rows[:, None] * stride_logits + experts[None, :],
                     mask=(experts < NUM_EXPERTS)[None, :], other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where((experts < NUM_EXPERTS)[None, :], p, -1.0)      # padding experts never win
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        best_id = tl.min(tl.where(p == best[:, None], experts[None, :], BLOCK_E), 1)
        weights = tl.where(slots[None, :] == k, best[:, None], weights)
        ids = tl.where(slots[None, :] == k, best_id[:, None], ids)
        p = tl.where(experts[None, :] == best_id[:, None], -1.0, p)
    if NORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    out = tokens[:, None] * TOP_K + slots[None, :]
    out_mask = (tokens < num_tokens)[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_mask)


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel twin of `route_ref` (router_logits [T, E], last dimension contiguous)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        block_t = min(triton.next_power_of_2(num_tokens), max(1, 4096 // block_e), 16)
        _route_kernel[(triton.cdiv(num_tokens, block_t),)](
            router_logits, weights, ids, num_tokens, router_logits.stride(0), NUM_EXPERTS=num_experts,
            BLOCK_E=block_e, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), NORMALIZE=norm_topk_prob,
            BLOCK_T=block_t, num_warps=4, **pdl_launch(router_logits))
    return weights, ids


def alignment_capacity(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Slots for every assignment plus each possible group's padding, a multiple of block_m: a bound
    that depends only on the shapes, so a batch's outputs keep their sizes (CUDA graphs)."""
    capacity = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-capacity // block_m) * block_m


def align_tokens_to_experts_ref(topk_ids: torch.Tensor, block_m: int,
                                num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flattened assignments (index token * K + k) by expert, each group padded to a
    multiple of block_m. Returns
      sorted_token_ids [P]: assignment indices in expert order; padding holds T * K (no assignment),
      expert_ids [P // block_m]: the expert of each tile; -1 for tiles past the end,
      num_tokens_post_padded [1]: where the padded groups end.
    P = alignment_capacity(T * K, E, block_m). Torch ops without a host sync (CUDA graphs)."""
    flat = topk_ids.flatten()
    num_assignments = flat.numel()
    capacity = alignment_capacity(num_assignments, num_experts, block_m)
    # scatter_add, not bincount: bincount on CUDA reads its maximum back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    order = torch.argsort(flat, stable=True)                # assignment indices, grouped by expert
    expert_of_sorted = flat[order]
    rank_in_group = torch.arange(num_assignments, device=flat.device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    destination = (padded_ends - padded_counts)[expert_of_sorted] + rank_in_group
    sorted_token_ids = torch.full((capacity,), num_assignments, dtype=torch.int64, device=flat.device)
    sorted_token_ids[destination] = order
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_ends, tile_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_token_ids, expert_ids, padded_ends[-1:]


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, tile_experts_ptr, end_ptr, num_assignments, capacity,
                  NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    experts = tl.arange(0, BLOCK_E)
    steps = tl.arange(0, BLOCK_A)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for a0 in range(0, num_assignments, BLOCK_A):
        ids = tl.load(ids_ptr + a0 + steps, mask=a0 + steps < num_assignments, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    end = tl.sum(padded, 0)
    tl.store(end_ptr, end.to(tl.int64))
    # each assignment at its group's start plus the count of its expert's assignments before it
    placed = ends - padded
    for a0 in range(0, num_assignments, BLOCK_A):
        a = a0 + steps
        ids = tl.load(ids_ptr + a, mask=a < num_assignments, other=-1).to(tl.int32)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        slot = tl.sum(one_hot * (tl.cumsum(one_hot, 0) - 1 + placed[None, :]), 1)
        tl.store(sorted_ptr + slot, a.to(tl.int64), mask=a < num_assignments)
        placed += tl.sum(one_hot, 0)
    # the rest hold "no assignment": each group's padding, then everything past the end
    pad = tl.arange(0, BLOCK_M)
    pad_slot = placed[:, None] + pad[None, :]
    tl.store(sorted_ptr + pad_slot, tl.full([BLOCK_E, BLOCK_M], num_assignments, tl.int64),
             mask=pad_slot < ends[:, None])
    for s0 in range(end, capacity, BLOCK_A):
        s = s0 + steps
        tl.store(sorted_ptr + s, tl.full([BLOCK_A], num_assignments, tl.int64), mask=s < capacity)
    # a tile's expert: how many groups end at or before its first slot (empty groups included)
    for t0 in range(0, capacity // BLOCK_M, BLOCK_A):
        t = t0 + steps
        expert = tl.sum((ends[None, :] <= (t * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(tile_experts_ptr + t, tl.where(expert < NUM_EXPERTS, expert, -1).to(tl.int64),
                 mask=t < capacity // BLOCK_M)


def align_tokens_to_experts(topk_ids: torch.Tensor, block_m: int,
                            num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_tokens_to_experts_ref`'s result, by one kernel on CUDA up to
    ALIGN_KERNEL_MAX_ASSIGNMENTS assignments (topk_ids contiguous) and by the twin otherwise."""
    num_assignments = topk_ids.numel()
    if not topk_ids.is_cuda or num_assignments > ALIGN_KERNEL_MAX_ASSIGNMENTS:
        return align_tokens_to_experts_ref(topk_ids, block_m, num_experts)
    return align_tokens_kernel(topk_ids, block_m, num_experts)


def align_tokens_kernel(topk_ids: torch.Tensor, block_m: int,
                        num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-program kernel itself, on any device (the CPU through Triton's interpreter)."""
    assert topk_ids.is_contiguous() and block_m & (block_m - 1) == 0
    num_assignments = topk_ids.numel()
    capacity = alignment_capacity(num_assignments, num_experts, block_m)
    sorted_token_ids = torch.empty(capacity, dtype=torch.int64, device=topk_ids.device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int64, device=topk_ids.device)
    end = torch.empty(1, dtype=torch.int64, device=topk_ids.device)
    _align_kernel[(1,)](topk_ids, sorted_token_ids, expert_ids, end, num_assignments, capacity,
                        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
                        BLOCK_M=block_m, BLOCK_A=min(128, max(16, triton.next_power_of_2(num_assignments))),
                        num_warps=4 if num_assignments <= 32 else 8, **pdl_launch(topk_ids))
    return sorted_token_ids, expert_ids, end
