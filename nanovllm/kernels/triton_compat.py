"""Triton when it is installed; otherwise a stand-in so the kernel modules and their torch twins
still import on machines without it (CPU-only torch does not bring Triton)."""
try:
    import triton
    import triton.language as tl
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

    triton = tl = _MissingTriton()
