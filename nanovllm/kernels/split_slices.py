"""K split into slices: each split of a tile stores its float32 sums in a slice of its own, and the
last of the tile's splits to arrive adds the slices and writes the output, in the same kernel.
Nothing is cleared (only the arrival count goes back to zero), so no program can clear sums another
has yet to read: with atomic adds into one set of sums that the last split read and cleared, Triton
stored the zeros in another thread layout than it loaded the sums, with no barrier between, and a
tile came out wrong about once in 600 calls (int4_gemm, H200).
"""
import torch

from nanovllm.kernels.triton_compat import tl, triton
from nanovllm.kernels.zeroed_workspace import last_to_arrive, zeroed_workspace


def split_slices(out: torch.Tensor, split_k: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 slices [split_k, *out.shape] and the `tiles` arrival counts (zero between calls:
    the kernel leaves them so) of a launch that splits K; unused placeholders (out) when it does not."""
    if split_k == 1:
        return out, out
    return (torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device),
            zeroed_workspace(out.device, torch.int32, tiles))


@triton.jit
def add_split_slices(sums, partial_ptr, out_ptr, offsets, mask, split, splits, slice_size, count):
    """Stores split `split`'s sums (float32, at `offsets` of a slice of `slice_size` elements) and,
    in the last of the tile's `splits` to arrive at `count`, writes their total to out_ptr + offsets."""
    tl.store(partial_ptr + split * slice_size + offsets, sums, mask=mask)
    if last_to_arrive(count, splits):
        total = tl.zeros_like(sums)
        for other in range(splits):   # .cg: read from L2, where the other SMs' stores landed
            total += tl.load(partial_ptr + other * slice_size + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(count, 0)
