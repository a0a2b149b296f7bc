"""Triton when it is installed; otherwise a stand-in so the kernel modules and their torch twins
still import on machines without it (CPU-only torch does not bring Triton). Also the launch option
every kernel shares: programmatic dependent launch on Hopper and newer GPUs."""
import functools

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
    if PDL:
        tl.extra.cuda.gdc_wait()
