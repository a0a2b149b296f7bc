"""Apply grammars' packed token bitmasks to logits in place: -inf where a token is not allowed.

Bit j of word w of a bitmask row allows token 32 w + j (xgrammar's layout). The bitmask holds only
the constrained rows, `rows[i]` naming the logits row that bitmask row i applies to, so a batch
with a few constrained sequences copies and reads only their masks. Tokens past the bitmask's end
(a vocabulary padded beyond ceil(vocab / 32) words) are not allowed.
"""
import torch

from nanovllm.kernels.triton_compat import tl, triton

BLOCK = 4096   # vocabulary entries per program


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1).bool()     # [k, 32 * words]
    vocab_size = logits.shape[1]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], float("-inf"))


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, stride_row, bitmask_ptr, num_words, rows_ptr, vocab_size,
                                BLOCK: tl.constexpr):
    i = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    w = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    words = tl.load(bitmask_ptr + i * num_words + w, mask=w < num_words, other=0)
    # row-major [words, 32 bits]: entry j is token 32 w + j
    banned = tl.reshape(((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0, [BLOCK])
    offs = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * stride_row + offs, float("-inf"), mask=(offs < vocab_size) & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits: [n, vocab] (any float dtype, last dim contiguous), changed in place; bitmask: [k,
    words] int32 (contiguous); rows: [k] int32, distinct rows of logits; all on one device."""
    k, num_words = bitmask.shape
    if k == 0:
        return
    vocab_size = logits.shape[1]
    _apply_token_bitmask_kernel[(k, triton.cdiv(vocab_size, BLOCK))](
        logits, logits.stride(0), bitmask, num_words, rows, vocab_size, BLOCK=BLOCK, num_warps=8)
