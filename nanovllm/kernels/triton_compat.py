"""Triton when it is installed; otherwise a stand-in so the kernel modules and their torch twins
still import on machines without it (CPU-only torch does not bring Triton)."""
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
        def jit(fn):
            return _MissingKernel(fn)

    triton = tl = libdevice = _MissingTriton()


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def uses_pdl(t: torch.Tensor) -> bool:
    """Programmatic dependent launch (Hopper and newer): a kernel launched with it may start while
    the kernel before it drains, and waits in wait_for_previous_kernel() before touching memory."""
    return t.is_cuda and _has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
