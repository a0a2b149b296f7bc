"""How AWQ and GPTQ checkpoints store integer weights, and the torch dequantizers that read them
(the reference every faster path is tested against).

Both formats keep w = (q - z) * s with unsigned integers q and z of `bits` bits, one scale s and
zero z per (group of input rows, output column), packed 32 // bits to an int32 word:
- AWQ (`version: "gemm"`, AutoAWQ's WQLinear_GEMM): qweight [in, out/8] packs 8 output columns per
  word in the interleaved order AWQ_PACK_ORDER (nibble i holds column AWQ_PACK_ORDER[i] of its 8),
  qzeros [in/g, out/8] the same way, scales fp16 [in/g, out].
- GPTQ (AutoGPTQ / GPTQModel): qweight [in*bits/32, out] packs consecutive input rows per word in
  plain order (row 8r+i in bits [4i, 4i+4) for 4 bits), qzeros [groups, out*bits/32] packs output
  columns in plain order, scales fp16 [groups, out], g_idx int32 [in] the group of each input row
  (not monotonic with `desc_act`). checkpoint_format "gptq" (v1, the default) stores z - 1,
  "gptq_v2" stores z.
"""
import torch

from nanovllm.kernels.int_gemm import in_step_order, to_step_order

# AutoAWQ awq/modules/linear/gemm.py (from_linear: order_map) and vLLM quant_utils (AWQ_PACK_ORDER)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] unsigned ints -> [rows * bits / 32, cols] int32, rows packed in plain order."""
    per_word = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0] // per_word, per_word, q.shape[1])
    shifts = (torch.arange(per_word, device=q.device) * bits).reshape(1, -1, 1)
    return _to_int32((q << shifts).sum(dim=1))


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack_rows: [words, cols] int32 -> [words * 32 / bits, cols] int32."""
    per_word = 32 // bits
    shifts = (torch.arange(per_word, device=packed.device) * bits).reshape(1, -1, 1)
    q = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(-1, packed.shape[1]).to(torch.int32)


def pack_columns(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[rows, cols] unsigned ints -> [rows, cols * bits / 32] int32; word slot i holds column
    order[i] of its group of 32 // bits columns (plain order when order is None)."""
    per_word = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0], -1, per_word)
    if order is not None:
        q = q[:, :, list(order)]
    shifts = torch.arange(per_word, device=q.device) * bits
    return _to_int32((q << shifts).sum(dim=2))


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of pack_columns."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=packed.device) * bits
    q = (packed.unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        q = q[:, :, _inverse(order)]
    return q.reshape(packed.shape[0], -1).to(torch.int32)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """AWQ gemm tensors -> the float32 weight [out, in] they stand for."""
    q = unpack_columns(qweight, 4, AWQ_PACK_ORDER)                       # [in, out]
    z = unpack_columns(qzeros, 4, AWQ_PACK_ORDER).repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).t().contiguous()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, zeros_minus_one: bool = True) -> torch.Tensor:
    """GPTQ tensors -> the float32 weight [out, in]; zeros_minus_one for checkpoint_format "gptq" (v1)."""
    q = unpack_rows(qweight, bits)                                         # [in, out]
    z = unpack_columns(qzeros, bits) + int(zeros_minus_one)                # [groups, out]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits -> int32 with the same bits (the top bit becomes the sign)."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def _inverse(order: tuple[int, ...]) -> list[int]:
    inverse = [0] * len(order)
    for slot, column in enumerate(order):
        inverse[column] = slot
    return inverse



def gemm_layout(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, act_order: bool,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layout of kernels/int_gemm.py from unpacked q [in, out] and zeros [groups, out] (groups
    of runs of rows unless act_order): rows packed in plain or step order, scales and zeros * scales in dtype."""
    group_size = q.shape[0] // scales.shape[0]
    if in_step_order(q.shape[0], bits, group_size, act_order):
        q = to_step_order(q)
    s = scales.float()
    return {"qweight": pack_rows(q, bits), "scales": s.to(dtype), "scaled_zeros": (zeros.float() * s).to(dtype)}


def awq_for_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return gemm_layout(unpack_columns(qweight, 4, AWQ_PACK_ORDER), unpack_columns(qzeros, 4, AWQ_PACK_ORDER),
                       scales, 4, False, dtype)


def gptq_for_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
                  zeros_minus_one: bool, dtype: torch.dtype, act_order: bool = False) -> dict[str, torch.Tensor]:
    """act_order: the layer keeps its g_idx (groups that are not runs of rows)."""
    return gemm_layout(unpack_rows(qweight, bits), unpack_columns(qzeros, bits) + int(zeros_minus_one), scales,
                       bits, act_order, dtype)
