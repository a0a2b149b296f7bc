"""Draw one token per row: argmax(scores / temperature + Gumbel noise), or argmax(scores) where the
temperature is 0. The Gumbel-max trick samples exactly from softmax(scores / temperature) with no
softmax, sort or cumulative sum.

Noise for every entry of a 152K vocabulary costs more than reading the scores, so the kernels
draw it in two stages: a first pass sums each CHUNK of the vocabulary (its log-sum-exp), a
Gumbel-max over those sums picks a chunk with exactly its share of the probability, and a second
Gumbel-max picks a token within that chunk: noise for CHUNK + chunks entries per row, not all.

Each row's noise comes from its own 64-bit seed, so a seeded request draws the same noise whatever
else is in the batch. The kernels draw it with Triton's Philox generator, four numbers per call;
the twin draws full-vocabulary noise with a torch.Generator seeded alike, so the two sample the same
distribution but not the same numbers.
"""
import torch

from nanovllm.kernels.triton_compat import libdevice, pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel

CHUNK = 4096   # vocabulary entries per program of the first pass; each writes its sum and its best index


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
def _chunk_summary_kernel(scores_ptr, stride_row, temperatures_ptr, chunk_value_ptr, chunk_best_ptr,
                          vocab_size, num_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Per (row, chunk): the log2-sum-exp2 of scores * log2(e) / temperature (sampled rows), or
    the maximum score (greedy rows), and the index of the chunk's best score."""
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(scores_ptr + row * stride_row + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        x = x * (1.4426950408889634 / temperature)
    best = tl.max(x, axis=0)
    value = best
    if temperature > 0:
        total = tl.sum(tl.where(x > float("-inf"), tl.exp2(x - best), 0.0), axis=0)   # 0 when all are -inf
        value = best + tl.log2(total)
    tl.store(chunk_value_ptr + row * num_chunks + chunk, value)
    tl.store(chunk_best_ptr + row * num_chunks + chunk, chunk * CHUNK + tl.argmax(x, axis=0))


@triton.jit
def _gumbel_noise(seed, first_counter, N: tl.constexpr, FAST_LOG: tl.constexpr):
    """N Gumbel draws in base 2 (-log2(-log2 u), a shifted and scaled Gumbel: the argmax is the same)
    from Philox counters first_counter.., four uniforms per counter. The inner log must be exact
    near u = 1, where the winning noise comes from; the outer one may be fast."""
    u0, u1, u2, u3 = tl.rand4x(seed, first_counter + tl.arange(0, N // 4))
    u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [N])
    exponential = -tl.log2(u)
    return -libdevice.fast_log2f(exponential) if FAST_LOG else -tl.log2(exponential)


@triton.jit
def _pick_token_kernel(scores_ptr, stride_row, temperatures_ptr, seeds_ptr, chunk_value_ptr, chunk_best_ptr,
                       tokens_ptr, vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
                       FAST_LOG: tl.constexpr, PDL: tl.constexpr):
    """One program per row: greedy rows take the best chunk's best index; sampled rows draw a chunk
    by Gumbel-max over the chunks' log-sum-exps (so with the chunk's share of the probability), then
    a token of it by Gumbel-max over its scores. Chunk noise and token noise use distinct counters."""
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_CHUNKS)
    value = tl.load(chunk_value_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        seed = tl.load(seeds_ptr + row)
        tokens_counters = num_chunks * (CHUNK // 4)     # the token draws use counters below this
        noisy = value + _gumbel_noise(seed, tokens_counters, BLOCK_CHUNKS, FAST_LOG)
        chunk = tl.argmax(tl.where(c < num_chunks, noisy, float("-inf")), axis=0)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < vocab_size
        x = tl.load(scores_ptr + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = x * (1.4426950408889634 / temperature) + _gumbel_noise(seed, chunk * (CHUNK // 4), CHUNK, FAST_LOG)
        token = (chunk * CHUNK + tl.argmax(tl.where(mask, x, float("-inf")), axis=0)).to(tl.int64)
    else:
        token = tl.load(chunk_best_ptr + row * num_chunks + tl.argmax(value, axis=0))
    tl.store(tokens_ptr + row, token)


def gumbel_argmax(scores: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """scores: [rows, vocab] (any float dtype, last dim contiguous); temperatures: [rows] float32;
    seeds: [rows] int64 on the same device."""
    rows, vocab_size = scores.shape
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    chunk_value = torch.empty(rows, num_chunks, dtype=torch.float32, device=scores.device)
    chunk_best = torch.empty(rows, num_chunks, dtype=torch.int64, device=scores.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=scores.device)
    _chunk_summary_kernel[(rows, num_chunks)](scores, scores.stride(0), temperatures, chunk_value, chunk_best,
                                              vocab_size, num_chunks, CHUNK=CHUNK, num_warps=8,
                                              **pdl_launch(scores))
    _pick_token_kernel[(rows,)](scores, scores.stride(0), temperatures, seeds, chunk_value, chunk_best, tokens,
                                vocab_size, num_chunks, CHUNK=CHUNK,
                                BLOCK_CHUNKS=max(4, triton.next_power_of_2(num_chunks)), num_warps=8,
                                FAST_LOG=scores.is_cuda,  # the interpreter lacks libdevice
                                **pdl_launch(scores))
    return tokens
