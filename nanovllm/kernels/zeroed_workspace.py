"""Scratch memory that kernels find zeroed and leave zeroed: the float32 sums and int32 arrival
counts through which the programs of one split reduction meet, the last to arrive finishing the
work and clearing what it used. No kernel around the reduction has to zero or cast anything.

One buffer per (device, dtype), grown when too small. Calls on one stream share it: a kernel
finishes (and clears) before the next one touches it. A reduction may also leave its sums there
for the next kernel to finish and clear (PendingSums): then no program of the reduction waits for
the others.
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.triton_compat import tl, triton

_buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []     # kept alive: CUDA graphs captured with them still write there


def zeroed_workspace(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """At least numel zeros of dtype on device (at least 2^14, and at least double the last size
    when it grows, so a few calls settle the size before CUDA graphs are captured)."""
    buffer = _buffers.get((device, dtype))
    if buffer is None or buffer.numel() < numel:
        if buffer is not None:
            _outgrown.append(buffer)
        buffer = torch.zeros(max(numel, 1 << 14, 0 if buffer is None else 2 * buffer.numel()), dtype=dtype,
                             device=device)
        _buffers[(device, dtype)] = buffer
    return buffer


def release_workspaces() -> None:
    """Drop every buffer (the engine's sleep, once no CUDA graph holds them); the next call
    allocates zeroed ones."""
    _buffers.clear()
    _outgrown.clear()


@triton.jit
def last_to_arrive(count, programs):
    """Counts this program in at `count` (an int32 of the workspace) and says whether it is the last
    of `programs` to arrive. What every thread stored before the call is then in L2 for the last
    one to read (with .cg): the barrier waits for all the threads' stores before the count is
    taken, and acq_rel orders them before it and the last program's reads after it. The last
    program stores 0 back to count for the next call."""
    tl.debug_barrier()
    return tl.atomic_add(count, 1, sem="acq_rel") == programs - 1


class PendingSums(NamedTuple):
    """A split reduction's float32 sums, left in the workspace: the kernel that reads them must clear
    them (rms_norm with a residual does)."""
    sums: torch.Tensor       # [M, N] float32, a view of the workspace
    dtype: torch.dtype       # the finished output's dtype
