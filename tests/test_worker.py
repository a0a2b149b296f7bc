"""The model runner's parts on their own: step inputs from a scheduled batch (hand-computed arrays),
the KV pool object, sampling tensors, and the loud failures of attention without a K/V store or a
backend."""
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.attention import current_metadata
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.worker.cuda_graph import longest_context_first
from nanovllm.worker.kv_cache import KVCache
from nanovllm.executor.sampling_inputs import build_sampling_tensors
from nanovllm.executor.step_inputs import build_step_inputs, pending_token_marker
from tests.conftest import mixed_prompts


def sequence(token_ids, block_table, num_computed, pending_row=None, **params) -> Sequence:
    seq = Sequence(token_ids, SamplingParams(**params))
    seq.block_table, seq.num_computed_tokens, seq.pending_row = block_table, num_computed, pending_row
    return seq


def test_prefill_inputs_by_hand():
    # a: 6-token prompt, 4 cached, computes its last 2 (completes: sampled); b: 5-token prompt
    # chunked, computes its first 3 (does not complete). Block size 4.
    a = sequence([10, 11, 12, 13, 14, 15], [7, 2], 4)
    b = sequence([20, 21, 22, 23, 24], [5, 9], 0)
    inputs = build_step_inputs(ScheduledBatch([a, b], [2, 3], True), block_size=4)
    assert inputs.is_prefill
    assert inputs.input_ids.tolist() == [14, 15, 20, 21, 22]
    assert inputs.positions.tolist() == [4, 5, 0, 1, 2]
    assert inputs.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]
    assert inputs.context_lens.tolist() == [6, 3]
    assert inputs.cu_seqlens_q.tolist() == [0, 2, 5]
    assert inputs.block_tables.tolist() == [[7, 2], [5, 9]]
    assert inputs.logits_indices.tolist() == [1]             # only a samples


def test_decode_inputs_encode_the_pending_token():
    # c has a collected last token; d's last token is still on the device, in row 3 of the last
    # sampler output
    c = sequence([1, 2, 3, 4, 5], [4, 8], 4)
    d = sequence([6, 7, 8], [3], 3, pending_row=3)
    assert d.num_tokens == 4 and d.token_ids == [6, 7, 8]
    inputs = build_step_inputs(ScheduledBatch([c, d], [1, 1], False), block_size=4)
    assert inputs.input_ids.tolist() == [5, pending_token_marker(3)]
    assert pending_token_marker(3) == -4
    assert inputs.positions.tolist() == [4, 3]
    assert inputs.slot_mapping.tolist() == [8 * 4 + 0, 3 * 4 + 3]
    assert inputs.context_lens.tolist() == [5, 4]
    assert inputs.block_tables.tolist() == [[4, 8], [3, 0]]  # padded with 0
    assert inputs.logits_indices.tolist() == [0, 1]


def test_graph_decode_order_is_longest_context_first_then_padding():
    order = longest_context_first(np.array([40, 300, 7, 300, 1]), size=8)
    assert order.tolist() == [1, 3, 0, 2, 4, 5, 6, 7]     # ties keep batch order


def test_kv_cache_sizes_and_views():
    layers = [Attention(4, 2, 16, 0.25) for _ in range(3)]
    cache = KVCache(layers, block_size=16, dtype=torch.float16, device=torch.device("cpu"))
    assert cache.block_bytes == 2 * 3 * 16 * 2 * 16 * 2        # K and V, layers, tokens, heads, dim, bytes
    assert cache.blocks_for_bytes(10 * cache.block_bytes + 1) == 10
    cache.allocate(5)
    assert cache.tensor.shape == (2, 3, 5, 16, 2, 16)
    layers[1].k_cache[4, 15, 1, 3] = 7.0
    assert cache.tensor[0, 1, 4, 15, 1, 3] == 7.0              # layers see views of the one pool
    cache.release()
    assert all(layer.k_cache.numel() == 0 for layer in layers)


def test_sampling_tensors_clamp_top_k_and_ban_stop_ids_until_min_tokens():
    seqs = [sequence([1, 2], [0], 2, temperature=1.0, top_k=2**63, min_tokens=3, stop_token_ids=[9]),
            sequence([1, 2], [0], 2, temperature=0.5, top_k=-1, ignore_eos=True, min_tokens=1, stop_token_ids=[8]),
            sequence([1, 2], [0], 2, temperature=0.0)]
    tensors = build_sampling_tensors(seqs, vocab_size=50, eos_token_ids=(2, 3), unseeded=np.random.default_rng(0),
                                     to_device=torch.from_numpy)
    assert tensors.top_k.tolist() == [50, 50, 50]
    assert tensors.banned_tokens == {0: [2, 3, 9], 1: [8]}
    assert tensors.temperatures.tolist() == [1.0, 0.5, 0.0] and not tensors.all_greedy


def test_metadata_outside_a_step_is_an_error():
    with pytest.raises(RuntimeError, match="outside a model runner step"):
        current_metadata()


def test_attention_without_a_backend_fails_loudly(model_paths, hf_greedy):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompt = mixed_prompts(500, lengths=(20,))[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == hf_greedy(llm.config.model, prompt, 4)
    for layer in llm.engine.core.executor.driver.attention_layers:
        layer.backend = None
    with pytest.raises(RuntimeError, match="no backend"):
        llm.generate([prompt], params, use_tqdm=False)
