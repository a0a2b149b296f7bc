"""What the Gluon GEMMs for Hopper (int4_gemm_hopper.py, fp8_gemm_hopper.py) share: a grid of one
program an SM that runs whole tiles in full waves and splits only the last wave's tiles in K
(`balanced_split`), and the epilogue that leaves a tile's sums out^T [BLOCK_N, rows] in the output,
or adds them into a zeroed float32 workspace from which the last split to arrive writes the tile.
"""
import torch

from nanovllm.kernels.zeroed_workspace import zeroed_workspace

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_GLUON = True
    # names that moved between Triton releases (checked on 3.6 and 3.9)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    sync_threads = getattr(gl, "barrier", None) or gl.thread_barrier
except (ImportError, AttributeError):    # no Triton, or one whose Gluon lacks these
    HAS_GLUON = False

MAX_TAIL_SPLITS = 4


def balanced_split(tiles: int, k_steps: int, sms: int) -> tuple[int, int]:
    """(tiles whose program runs K whole, the K splits of each of the rest) for a grid of one program an
    SM. A grid of fewer tiles than SMs splits every tile until about one program an SM; a larger one
    runs whole tiles in full waves and splits the last wave's tiles, when they fill less than half of
    it, so they end with the rest (gate_up's 192 tiles: 132 whole, 60 in halves)."""
    waves, tail = divmod(tiles, sms)
    splits = min(MAX_TAIL_SPLITS, k_steps, sms // tail if tail else 1)
    if waves == 0 or splits < 2:
        return (0, splits) if waves == 0 else (tiles, 1)
    return tiles - tail, splits


def split_workspace(out: torch.Tensor, tiles: int, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 sums and a tile's arrival counts of a launch that splits K, zero between calls
    (the kernel leaves them so); unused placeholders otherwise."""
    if not split:
        return out, out
    return (zeroed_workspace(out.device, torch.float32, out.numel()),
            zeroed_workspace(out.device, torch.int32, tiles))


if HAS_GLUON:
    @gluon.jit
    def program_tile(K, K_PER_SPLIT, M_TILES, WHOLE_TILES, TAIL_SPLITS, BLOCK_K: gl.constexpr):
        """(tile, its row tile, its column tile, first column of K, steps of BLOCK_K, whether split) of
        this program: programs from WHOLE_TILES on take TAIL_SPLITS K ranges of one tile each
        (balanced_split); a tile's row tiles lie next to each other, so they read its weights together."""
        program = gl.program_id(0)
        in_tail = (program >= WHOLE_TILES).to(gl.int32)
        tail = (program - WHOLE_TILES) * in_tail
        tile = program - tail + tail // TAIL_SPLITS
        k_start = (tail % TAIL_SPLITS) * K_PER_SPLIT
        k_span = K + in_tail * (K_PER_SPLIT - K)
        steps = gl.maximum(gl.cdiv(gl.minimum(k_span, K - k_start), BLOCK_K), 1)
        return tile, tile % M_TILES, tile // M_TILES, k_start, steps, in_tail * TAIL_SPLITS > 1

    @gluon.jit
    def ready_barriers(STAGES: gl.constexpr):
        """One mbarrier a buffer of the ring, each signalled when that buffer's TMA loads land."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        return ready

    @gluon.jit
    def retire_step(step, steps, sums, sums2, EXTRA_M: gl.constexpr):
        """End a main-loop step of K: at the last, wait for its products here (after the loop, ptxas
        12.8 / 12.9 moved the epilogue's reads of the chained sums above the wait, and the last
        product went missing); then the barrier after which the buffer the next load fills, read by
        the step before's products, is retired in every warp. sums2 is read only where EXTRA_M > 0."""
        if step + 1 == steps:
            if EXTRA_M > 0:
                warpgroup_mma_wait(num_outstanding=0, deps=(sums, sums2))
            else:
                warpgroup_mma_wait(num_outstanding=0, deps=(sums,))
        sync_threads()

    @gluon.jit
    def drained(sums, sums2, ready, STAGES: gl.constexpr, EXTRA_M: gl.constexpr):
        """The sums (and the second piece's, or the first's again without one) once every product is
        retired, the ring's mbarriers invalidated."""
        sums = warpgroup_mma_wait(num_outstanding=0, deps=(sums,))
        if EXTRA_M > 0:
            sums2 = warpgroup_mma_wait(num_outstanding=0, deps=(sums2,))
        else:
            sums2 = sums
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        return sums, sums2

    @gluon.jit
    def _halves(t):
        """[R, C] -> its column halves (the column's top bit is a register's: nothing moves)."""
        return gl.split(gl.permute(gl.reshape(t, [t.shape[0], 2, t.shape[1] // 2]), (0, 2, 1)))

    @gluon.jit
    def _piece_offsets(piece, row0, off_n, M, N):
        rows = row0 + gl.arange(0, piece.shape[1], layout=gl.SliceLayout(0, piece.type.layout))
        cols = off_n + gl.arange(0, piece.shape[0], layout=gl.SliceLayout(1, piece.type.layout))
        offsets = gl.expand_dims(rows, 0) * N + gl.expand_dims(cols, 1)
        return offsets, gl.expand_dims(rows < M, 0) & gl.expand_dims(cols < N, 1)

    @gluon.jit
    def _store_piece(piece, row0, off_n, M, N, out_ptr, partial_ptr, SPLIT: gl.constexpr, split):
        """out^T's piece [BLOCK_N, R] from row0: added into the split's float32 sums (split: this program's
        tile is split; SPLIT: some tile of the launch is, so partial_ptr is float32), or stored."""
        # four neighbouring columns a thread, so each thread's adds and stores are one vector (a lane
        # per four columns, the rest of the warp's lanes across rows: no element held twice, no add twice)
        LANES_N: gl.constexpr = min(32, piece.shape[0] // 4)
        piece = gl.convert_layout(piece, gl.BlockedLayout([4, 1], [LANES_N, 32 // LANES_N], [1, gl.num_warps()],
                                                          [0, 1]))
        offsets, mask = _piece_offsets(piece, row0, off_n, M, N)
        if SPLIT:
            if split:
                gl.atomic_add(partial_ptr + offsets, piece, mask=mask, sem="relaxed")
            else:
                gl.store(out_ptr + offsets, piece.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            gl.store(out_ptr + offsets, piece.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _store_sums(sums, row0, off_n, M, N, out_ptr, partial_ptr, SPLIT: gl.constexpr, split):
        """out^T's [BLOCK_N, R] sums (R up to 128) from row0, in pieces of at most 32 rows: pointers for
        a wider piece would take every register."""
        if sums.shape[1] <= 32:
            _store_piece(sums, row0, off_n, M, N, out_ptr, partial_ptr, SPLIT, split)
        else:
            halves = _halves(sums)
            for h in gl.static_range(2):
                quarters = _halves(halves[h])
                for q in gl.static_range(2):
                    _store_piece(quarters[q], row0 + (2 * h + q) * (sums.shape[1] // 4), off_n, M, N, out_ptr,
                                 partial_ptr, SPLIT, split)

    @gluon.jit
    def _store_tile_sums(sums, row0, off_n, M, N, out_ptr, partial_ptr, SPLIT: gl.constexpr, split):
        """A tile's sums out^T [BLOCK_N, R], R up to 256 rows from row0: stored into out [M, N], or, in a
        split tile, added into the float32 workspace partial_ptr (_finish_split_tile writes it out)."""
        if sums.shape[1] <= 128:
            _store_sums(sums, row0, off_n, M, N, out_ptr, partial_ptr, SPLIT, split)
        else:
            halves = _halves(sums)
            for h in gl.static_range(2):
                _store_sums(halves[h], row0 + h * (sums.shape[1] // 2), off_n, M, N, out_ptr, partial_ptr, SPLIT,
                            split)

    @gluon.jit
    def _finish_split_tile(arrivals, partial_ptr, out_ptr, off_m, off_n, M, N, SPLITS, BLOCK_N: gl.constexpr,
                          ROWS: gl.constexpr, num_warps: gl.constexpr):
        """After a split tile's sums are added (and the program's threads synchronized): the last of its
        programs to arrive writes the sums out and leaves them and the count at zero (counted in as
        zeroed_workspace.last_to_arrive does, in Gluon's operations)."""
        if gl.atomic_add(arrivals, 1, sem="acq_rel") == SPLITS - 1:
            LANES_N: gl.constexpr = min(32, BLOCK_N // 4)
            rows_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // LANES_N, LANES_N], [num_warps, 1], [1, 0])
            FINISH_ROWS: gl.constexpr = min(32, ROWS & -ROWS)    # (so 128 + 16 rows are finished whole)
            for r in gl.static_range(ROWS // FINISH_ROWS):
                rows = off_m + r * FINISH_ROWS + gl.arange(0, FINISH_ROWS, layout=gl.SliceLayout(1, rows_layout))
                out_cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows_layout))
                row_offsets = gl.expand_dims(rows, 1) * N + gl.expand_dims(out_cols, 0)
                row_mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(out_cols < N, 0)
                total = gl.load(partial_ptr + row_offsets, mask=row_mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + row_offsets, total.to(out_ptr.dtype.element_ty), mask=row_mask)
                gl.store(partial_ptr + row_offsets, gl.zeros_like(total), mask=row_mask)
            gl.store(arrivals, 0)

    @gluon.jit
    def leave_tile(sums, sums2, tile, off_m, off_n, M, N, out_ptr, partial_ptr, arrivals_ptr, SPLIT: gl.constexpr,
                   split, TAIL_SPLITS, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, EXTRA_M: gl.constexpr,
                   num_warps: gl.constexpr):
        """A tile's sums out^T (sums: its BLOCK_M rows from off_m; sums2: the EXTRA_M after them, read
        only where EXTRA_M > 0) into the output, or, split, into the workspace, the last split to
        arrive writing the tile."""
        _store_tile_sums(sums, off_m, off_n, M, N, out_ptr, partial_ptr, SPLIT, split)
        if EXTRA_M > 0:
            _store_tile_sums(sums2, off_m + BLOCK_M, off_n, M, N, out_ptr, partial_ptr, SPLIT, split)
        if SPLIT:
            sync_threads()
            if split:     # (nested, not `and`: both sides of an `and` would run)
                _finish_split_tile(arrivals_ptr + tile, partial_ptr, out_ptr, off_m, off_n, M, N, TAIL_SPLITS,
                                  BLOCK_N, BLOCK_M + EXTRA_M, num_warps)
