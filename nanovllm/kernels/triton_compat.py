"""Triton when it is installed; otherwise a stand-in so the kernel modules and their torch twins
still import on machines without it (CPU-only torch does not bring Triton). Also the launch option
every kernel shares: programmatic dependent launch on Hopper and newer GPUs; and INTERPRETED, whether
kernels run in Triton's CPU interpreter."""
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.__name__ = fn.__name__

        def __getitem__(self, grid):
            raise ImportError(f"{self.__name__} is a Triton kernel and triton is not installed")

    class _MissingTriton:
        constexpr = object   # kernel signatures name it in annotations

        @staticmethod
        def jit(fn=None, **options):          # @triton.jit or @triton.jit(do_not_specialize=...)
            return _MissingKernel(fn) if fn is not None else _MissingKernel

    triton = tl = libdevice = _MissingTriton()

# Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, read as Triton reads it: when
# kernels are defined), where a few casts round unlike a GPU's; kernels test it to mend those there only
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1") if HAS_TRITON else False


@functools.cache
def _major_capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def cuda_major_capability(t: torch.Tensor) -> int:
    """The compute capability's major number of the GPU that holds t (9: Hopper); 0 off CUDA."""
    if not t.is_cuda:
        return 0
    return _major_capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """Launch arguments for a kernel that starts with wait_for_previous_kernel(PDL) and works on t.
    With programmatic dependent launch the GPU may schedule the kernel while the one before it
    drains; the kernel then waits for that one's results before touching memory."""
    on = cuda_major_capability(t) >= 9
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the kernel before has finished and its
    writes are visible. Every kernel launched with pdl_launch calls this before it touches memory,
    so one that starts early reads nothing stale and overwrites nothing still being read."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start_next_kernel(PDL: tl.constexpr):
    """Let the next kernel launch now rather than when this one ends, if this one has few programs
    (at most 128, about one per SM of an H100: norms, rotary, attention and sampling at small
    batches). They leave most SMs idle; the next kernel's programs take those and wait there, so
    its launch and start-up overlap this kernel. On an H100 (8B shape, docs/benchmarks.md) a
    batch-1 step with FP8 weights ran 3.58 ms per token, against 3.67-3.69 without, and an AWQ
    step 2% faster. GEMVs and GEMMs, which fill the GPU, never call it (an AWQ step ran 4% slower
    when its 4-bit GEMVs did); larger grids (prefills, big batches) keep the launch at the end,
    since bench.py ran 1.1% slower when they too started their successors early."""
    if PDL:
        if tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) <= 128:
            tl.extra.cuda.gdc_launch_dependents()
