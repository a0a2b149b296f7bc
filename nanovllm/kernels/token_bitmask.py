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
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = tl.load(bitmask_ptr + i * num_words + offs // 32, mask=offs < num_words * 32, other=0)
    banned = ((word >> (offs % 32)) & 1) == 0
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
