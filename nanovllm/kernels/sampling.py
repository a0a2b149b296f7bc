"""Draw one token per row: argmax(scores / temperature + Gumbel noise), or argmax(scores) where the
temperature is 0. The Gumbel-max trick samples exactly from softmax(scores / temperature) with one
read of the scores and no softmax, sort or cumulative sum.

Each row's noise comes from its own 64-bit seed, so a seeded request draws the same noise whatever
else is in the batch. The kernel draws it with Triton's Philox generator, four numbers per call; the
twin draws it with a torch.Generator seeded alike, so the two sample the same distribution but not
the same numbers.
"""
import torch

from nanovllm.kernels.triton_compat import libdevice, pdl_launch, tl, triton, wait_for_previous_kernel

CHUNK = 4096   # vocabulary entries per program; each writes its best (score, index)


def gumbel_argmax_ref(scores: torch.Tensor, temperatures: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    tokens = scores.argmax(dim=-1)
    for row, (temperature, seed) in enumerate(zip(temperatures.tolist(), seeds)):
        if temperature > 0:
            generator = torch.Generator(scores.device).manual_seed(seed)
            u = torch.rand(scores.shape[1], generator=generator, device=scores.device)
            gumbel = -torch.log(-torch.log(u))
            tokens[row] = (scores[row].float() / temperature + gumbel).argmax()
    return tokens


@triton.jit
def _gumbel_argmax_kernel(scores_ptr, stride_row, temperatures_ptr, seeds_ptr, best_score_ptr, best_index_ptr,
                          vocab_size, num_chunks, CHUNK: tl.constexpr, FAST_LOG: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < vocab_size
    x = tl.load(scores_ptr + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        # one Philox call gives four uniforms: entry 4i+j of the chunk takes draw j of counter i,
        # so counters stay distinct across the whole vocabulary
        seed = tl.load(seeds_ptr + row)
        u0, u1, u2, u3 = tl.rand4x(seed, chunk * (CHUNK // 4) + tl.arange(0, CHUNK // 4))
        u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [CHUNK])
        # x / T - ln(-ln u), in base 2 (scaled by log2(e), which keeps the argmax). The inner log
        # must be exact near u = 1, where the winning noise comes from; the outer one may be fast.
        exponential = -tl.log2(u)
        noise = -libdevice.fast_log2f(exponential) if FAST_LOG else -tl.log2(exponential)
        x = x * (1.4426950408889634 / temperature) + noise
        x = tl.where(mask, x, float("-inf"))
    best = tl.argmax(x, axis=0)
    tl.store(best_score_ptr + row * num_chunks + chunk, tl.max(x, axis=0))
    tl.store(best_index_ptr + row * num_chunks + chunk, chunk * CHUNK + best)


def gumbel_argmax(scores: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """scores: [rows, vocab] (any float dtype, last dim contiguous); temperatures: [rows] float32;
    seeds: [rows] int64 on the same device."""
    rows, vocab_size = scores.shape
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    best_score = torch.empty(rows, num_chunks, dtype=torch.float32, device=scores.device)
    best_index = torch.empty(rows, num_chunks, dtype=torch.int64, device=scores.device)
    _gumbel_argmax_kernel[(rows, num_chunks)](scores, scores.stride(0), temperatures, seeds, best_score,
                                              best_index, vocab_size, num_chunks, CHUNK=CHUNK, num_warps=8,
                                              FAST_LOG=scores.is_cuda,  # the interpreter lacks libdevice
                                              **pdl_launch(scores))
    return best_index.gather(1, best_score.argmax(dim=1, keepdim=True)).squeeze(1)
