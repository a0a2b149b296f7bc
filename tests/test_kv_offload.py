"""The prefix cache's host tier (kv_offload_gib): the block manager's books on their own (against a
simulated device that makes the recorded copies), the copies themselves (float8 bytes come back
exactly), and whole engines whose GPU pool is too small for a multi-turn workload: with the tier
their outputs equal the engine's without it (and transformers'), and returning conversations find
their history in host memory instead of recomputing it."""
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager, HostHit
from nanovllm.core.sequence import Sequence
from nanovllm.kernels.fp8_primitives import FP8_DTYPE
from nanovllm.serve.cli import parse_args
from nanovllm.serve.metrics import EngineStatsCollector
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from nanovllm.worker.kv_cache import KVCache
from nanovllm.worker import kv_offload
from nanovllm.worker.kv_offload import HostKVCache
from tests.test_interrupts import assert_consistent, fail_on_call, restore
from tests.test_moe_engine import write_tiny_moe

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# A GPU pool of 16 blocks of 16 tokens (one max_model_len sequence) under four conversations of
# 60-100 tokens: every turn evicts the others' histories. 1 MiB of host tier holds them all.
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=256, max_num_batched_tokens=256,
              max_num_seqs=8)
HOST = dict(kv_offload_gib=1 / 1024)


# ---- the books, no model ---------------------------------------------------------------------

def make_seq(token_ids: list[int]) -> Sequence:
    return Sequence(list(token_ids), SamplingParams())


def admit(bm: BlockManager, token_ids: list[int]) -> tuple[Sequence, list]:
    seq = make_seq(token_ids)
    prefix = bm.find_cached_prefix(seq)
    assert bm.can_allocate(seq, seq.num_tokens, prefix)
    bm.allocate(seq, seq.num_tokens, prefix)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq, len(prefix) * BS)
    return seq, prefix


def host_blocks_by_hash(bm: BlockManager) -> list[int]:
    """The host tier's hashes, least recently used first."""
    return [bm.host.block_hash[b] for b in bm.host.lru]


def assert_host_consistent(bm: BlockManager) -> None:
    host = bm.host
    assert not host.reading and not bm.pending_offloads and not bm.pending_loads
    assert sorted(list(host.empty_blocks) + list(host.lru)) == list(range(host.num_blocks))
    assert {b: h for h, b in host.hash_to_block.items()} == host.block_hash
    assert set(host.block_token_ids) == set(host.lru)


def test_both_tiers_evict_least_recently_used_first():
    """GPU blocks leave in LRU order, each to the host tier (a copy recorded before its slot is
    reused); a full host tier drops its own LRU block, but not one a recorded load still reads."""
    bm = BlockManager(3, BS, num_host_blocks=2)
    a, b, c, d, e = (list(range(100 * k, 100 * k + BS)) for k in range(1, 6))
    hash_of = {k: bm.block_hashes(make_seq(t))[0] for k, t in zip("abcde", (a, b, c, d, e))}
    for tokens in (a, b, c):
        bm.free(admit(bm, tokens)[0])
    assert [bm.hash_to_block[hash_of[k]] for k in "abc"] == [0, 1, 2]
    assert bm.take_block_transfers() == ([], [])

    bm.free(admit(bm, d)[0])                        # takes the GPU's LRU block: a's
    assert bm.take_block_transfers() == ([(0, 0)], [])
    bm.free(admit(bm, e)[0])                        # then b's
    assert bm.take_block_transfers() == ([(1, 1)], [])
    assert host_blocks_by_hash(bm) == [hash_of["a"], hash_of["b"]]

    # a returns (one more token, so its full block is looked up): only the host tier has it
    seq, prefix = admit(bm, a + [7])
    assert prefix == [HostHit(0)] and seq.block_table == [2, 0]
    offloads, loads = bm.take_block_transfers()
    # its fresh GPU block was c's (the GPU's LRU), its second d's. Each went to the host tier in
    # place of the host's LRU block, skipping a's, which the load reads: b's, then c's there.
    assert loads == [(0, 2)] and offloads == [(2, 1), (0, 1)]
    assert host_blocks_by_hash(bm) == [hash_of["a"], hash_of["d"]]
    assert bm.find_cached_prefix(make_seq(b + [7])) == []                  # gone from both tiers
    assert bm.find_cached_prefix(make_seq(c + [7])) == []
    assert bm.find_cached_prefix(make_seq(d + [7])) == [HostHit(1)]
    assert bm.find_cached_prefix(make_seq(a + [7])) == [2]                  # on the GPU again
    bm.free(seq)
    assert bm.num_offloaded_blocks == 4 and bm.num_loaded_blocks == 1
    assert_host_consistent(bm)


def test_host_hits_need_matching_tokens_and_leave_the_last_token():
    bm = BlockManager(4, BS, num_host_blocks=4)
    history = list(range(10, 10 + 2 * BS))
    bm.free(admit(bm, history)[0])
    bm.free(admit(bm, list(range(500, 500 + 4 * BS)))[0])   # evicts both history blocks to the host
    bm.take_block_transfers()
    assert bm.find_cached_prefix(make_seq(history)) == [HostHit(1)]      # last token never served
    assert bm.find_cached_prefix(make_seq(history + [1])) == [HostHit(1), HostHit(0)]
    host_block = bm.host.hash_to_block[bm.block_hashes(make_seq(history))[0]]
    bm.host.block_token_ids[host_block] = (0,) * BS                        # a hash collision
    assert bm.find_cached_prefix(make_seq(history + [1])) == []


def test_a_prefix_can_mix_gpu_and_host_blocks():
    """Blocks still on the GPU are shared; those only in host memory are loaded in between."""
    bm = BlockManager(6, BS, num_host_blocks=4)
    history = list(range(10, 10 + 3 * BS))
    seq, _ = admit(bm, history)
    first, second, third = seq.block_table
    bm.free(seq)                                   # LRU: third, second, first
    bm.free(admit(bm, list(range(500, 500 + 4 * BS)))[0])   # 3 empty blocks, then the third's
    bm.take_block_transfers()
    prefix = bm.find_cached_prefix(make_seq(history + [1]))
    assert prefix == [first, second, HostHit(0)] and bm.num_blocks_needed(make_seq([]), 0, prefix) == 3


def test_reset_forgets_blocks_whose_copies_may_not_have_run():
    bm = BlockManager(2, BS, num_host_blocks=2)
    a = list(range(10, 10 + BS))
    bm.free(admit(bm, a)[0])
    bm.free(admit(bm, list(range(50, 50 + 2 * BS)))[0])     # a's block offloaded
    bm.take_block_transfers()
    assert bm.take_block_transfers() == ([], [])             # a step without copies ran since
    seq, prefix = admit(bm, a + [1])                         # a load recorded, never sent
    assert prefix == [HostHit(0)]
    bm.reset()                                               # the step was lost
    assert bm.find_cached_prefix(make_seq(a + [1])) == [HostHit(0)]   # the offload ran before
    assert all(block.hash is None for block in bm.blocks if block.block_id == seq.block_table[0])
    assert_host_consistent(bm)
    # an offload taken by the lost step is forgotten too
    bm = BlockManager(2, BS, num_host_blocks=2)
    bm.free(admit(bm, a)[0])
    bm.free(admit(bm, list(range(50, 50 + 2 * BS)))[0])
    assert bm.take_block_transfers()[0]
    bm.reset()
    assert bm.find_cached_prefix(make_seq(a + [1])) == []
    assert_host_consistent(bm)


def test_recorded_copies_keep_every_prefix_block_right():
    """A random workload of overlapping prompts over small pools, against a simulated device that
    makes each step's recorded copies (offloads, then loads) and then writes the computed tokens:
    every block a prompt is given as cached holds exactly that prompt's tokens."""
    rng = random.Random(0)
    bm = BlockManager(12, BS, num_host_blocks=6)
    gpu: list[tuple | None] = [None] * 12
    host: list[tuple | None] = [None] * 6
    documents = [[rng.randrange(1000) for _ in range(5 * BS)] for _ in range(5)]
    live: list[Sequence] = []
    host_hits = 0
    for _ in range(300):
        doc = rng.choice(documents)
        seq = make_seq(doc[:rng.randrange(1, len(doc))] + [rng.randrange(1000) for _ in range(rng.randrange(3))])
        prefix = bm.find_cached_prefix(seq)
        while not bm.can_allocate(seq, seq.num_tokens, prefix):
            bm.free(live.pop(0))
        bm.allocate(seq, seq.num_tokens, prefix)
        offloads, loads = bm.take_block_transfers()
        for g, h in offloads:
            host[h] = gpu[g]
        for h, g in loads:
            gpu[g] = host[h]
        for i in range(len(prefix)):
            assert gpu[seq.block_table[i]] == tuple(seq.token_ids[i * BS:(i + 1) * BS])
        host_hits += bm.num_host_hits(prefix)
        for i in range(len(prefix), len(seq.block_table)):      # the step computes the rest
            gpu[seq.block_table[i]] = tuple(seq.token_ids[i * BS:(i + 1) * BS])
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq, len(prefix) * BS)
        live.append(seq)
        if rng.random() < 0.5:
            bm.free(live.pop(rng.randrange(len(live))))
    assert host_hits > 30
    for seq in live:
        bm.free(seq)
    assert bm.num_used_blocks == 0
    assert_host_consistent(bm)


# ---- the copies --------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_blocks_round_trip_exactly(dtype, device, monkeypatch):
    """Whole blocks, every layer's keys and values, byte for byte, through a staging slot of two
    blocks (so three blocks take two rounds; on CUDA through pinned memory and a side stream)."""
    layers = [SimpleNamespace(num_kv_heads=2, head_dim=8) for _ in range(3)]
    cache = KVCache(layers, 16, dtype, torch.device(device))
    monkeypatch.setattr(kv_offload, "STAGING_BYTES", 4 * cache.block_bytes)
    cache.allocate(8)
    cache.tensor.view(torch.uint8).copy_(torch.randint(0, 256, cache.tensor.shape + (dtype.itemsize,),
                                                       dtype=torch.uint8).flatten(-2))
    original = cache.tensor.to("cpu", copy=True)
    host = HostKVCache(cache, 4)
    assert host.slot_blocks == 2
    host.transfer(np.array([[5, 2], [1, 3], [6, 0]]), np.zeros((0, 2), np.int64))
    cache.tensor.zero_()
    host.transfer(np.zeros((0, 2), np.int64), np.array([[3, 7], [2, 0], [0, 4]]))
    stored = cache.tensor.cpu()      # (waits for the copies)
    for source, destination in ((1, 7), (5, 0), (6, 4)):
        assert torch.equal(stored[:, :, destination].view(torch.uint8), original[:, :, source].view(torch.uint8))
    assert not stored[:, :, [1, 2, 3, 5, 6]].view(torch.uint8).any()    # nothing else written
    host.release()


# ---- engines -----------------------------------------------------------------------------------

def multi_turn(llm: LLM, num_convs: int = 4, turns: int = 3, seed: int = 0) -> tuple[list, list, list]:
    """Conversations that come back with their history, a reply and a new message each turn:
    (every prompt, every reply, every num_cached_tokens), turn by turn."""
    rng = random.Random(seed)
    vocab = llm.config.model_config.vocab_size
    histories = [[rng.randrange(3, vocab) for _ in range(rng.randrange(50, 70))] for _ in range(num_convs)]
    prompts, replies, cached = [], [], []
    for _ in range(turns):
        prompts += [list(h) for h in histories]
        outputs = llm.generate(histories, GREEDY, use_tqdm=False)
        replies += [o["token_ids"] for o in outputs]
        cached += [o["num_cached_tokens"] for o in outputs]
        for history, output in zip(histories, outputs):
            history += output["token_ids"] + [rng.randrange(3, vocab) for _ in range(10)]
    return prompts, replies, cached


@pytest.fixture(scope="module")
def reference(model_paths):
    """The qwen3 workload without a host tier: its prompts, replies and cache hits."""
    with LLM(model_paths["gqa_tied"], **ENGINE) as llm:
        return multi_turn(llm)


@pytest.fixture(scope="module")
def offload_llm(model_paths):
    with LLM(model_paths["gqa_tied"], **ENGINE, **HOST) as llm:
        yield llm


def test_returning_conversations_load_their_history_from_host_memory(offload_llm, reference, hf_greedy):
    prompts, replies, cached = multi_turn(offload_llm)
    ref_prompts, ref_replies, ref_cached = reference
    assert prompts == ref_prompts and replies == ref_replies
    # the GPU pool alone lost the histories; with the host tier every returning conversation finds
    # all its full blocks but the one holding its last token
    assert sum(ref_cached[4:]) < sum(cached[4:]) and cached[:4] == [0] * 4
    # (the last prompt token is computed, and of the turn before, so were all but its reply's last)
    assert cached[4:] == [min(len(p) - 1, len(before) + GREEDY.max_tokens - 1) // 16 * 16
                          for p, before in zip(prompts[4:], prompts)]
    stats = offload_llm.stats()
    assert stats["kv_offload_blocks_offloaded"] > 0 and stats["kv_offload_blocks_loaded"] > 0
    assert stats["prefix_cache_host_hits"] >= sum(cached[4:]) - sum(ref_cached[4:])
    assert 0 < stats["kv_offload_usage"] <= 1
    assert_consistent(offload_llm)
    assert_host_consistent(offload_llm.engine.core.scheduler.block_manager)
    for prompt, reply in list(zip(prompts, replies))[::3]:
        assert reply == hf_greedy(offload_llm.config.model, prompt, GREEDY.max_tokens)


def test_metrics_report_the_host_tier(offload_llm):
    multi_turn(offload_llm, turns=2)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(offload_llm.stats, "m"))
    samples = {s.name: s.value for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    stats = offload_llm.stats()
    assert samples["nanovllm:kv_offload_usage_perc"] == stats["kv_offload_usage"]
    assert samples["nanovllm:kv_offload_blocks_offloaded_total"] == stats["kv_offload_blocks_offloaded"] > 0
    assert samples["nanovllm:kv_offload_blocks_loaded_total"] == stats["kv_offload_blocks_loaded"] > 0
    assert samples["nanovllm:prefix_cache_host_hits_total"] == stats["prefix_cache_host_hits"] > 0


@pytest.mark.parametrize("point,error,after", [("transfer", KeyboardInterrupt, False),
                                               ("transfer", RuntimeError, True),
                                               ("forward", KeyboardInterrupt, False)])
def test_interrupted_steps_leak_nothing_and_keep_outputs(offload_llm, reference, point, error, after):
    """Interrupted before, or right after, a step's copies (or in its forward pass): both tiers end
    consistent, and the workload that follows gives the same replies."""
    runner = offload_llm.engine.core.executor
    target = runner.driver.host_kv_cache if point == "transfer" else runner.driver.model.model.layers[-1].mlp
    name = "transfer" if point == "transfer" else "forward"
    fail_on_call(target, name, 2, error, after)
    try:
        with pytest.raises(error):
            multi_turn(offload_llm)
    finally:
        restore(target, name)
    assert_consistent(offload_llm)
    assert_host_consistent(offload_llm.engine.core.scheduler.block_manager)
    assert offload_llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    assert multi_turn(offload_llm)[1] == reference[1]


def test_abort_leaks_nothing(offload_llm, reference):
    for k, prompt in enumerate(reference[0][4:8]):
        offload_llm.engine.add_request(prompt, GREEDY, request_id=f"abort{k}")
    for _ in range(3):
        offload_llm.engine.step()
    for k in range(4):
        offload_llm.engine.abort(f"abort{k}")
    assert offload_llm.engine.is_finished() and offload_llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    assert_consistent(offload_llm)
    assert_host_consistent(offload_llm.engine.core.scheduler.block_manager)
    assert multi_turn(offload_llm)[1] == reference[1]


def test_preempted_sequences_come_back_through_the_host_tier(offload_llm, model_paths, hf_greedy):
    """A pool too small for the batch's decodes preempts; a preempted sequence's full blocks, once
    evicted, return from host memory when it is admitted again. The tokens stay transformers'."""
    prompts = [[random.Random(k).randrange(3, 500) for _ in range(60)] for k in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = offload_llm.stats()
    preemptions = offload_llm.engine.core.scheduler.num_preemptions
    outputs = offload_llm.generate(prompts, params, use_tqdm=False)
    assert offload_llm.engine.core.scheduler.num_preemptions > preemptions
    assert offload_llm.stats()["kv_offload_blocks_loaded"] > before["kv_offload_blocks_loaded"]
    for prompt, output in list(zip(prompts, outputs))[::2]:
        assert output["token_ids"] == hf_greedy(model_paths["gqa_tied"], prompt, 24)
    assert_consistent(offload_llm)
    assert_host_consistent(offload_llm.engine.core.scheduler.block_manager)


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory):
    paths = {name: write_tiny_model(str(tmp_path_factory.mktemp(name)), architecture=arch, seed=seed)
             for name, arch, seed in (("qwen2", "Qwen2ForCausalLM", 4), ("llama", "LlamaForCausalLM", 5),
                                      ("mistral", "MistralForCausalLM", 6))}
    paths["qwen3_moe"] = write_tiny_moe(str(tmp_path_factory.mktemp("qwen3_moe")), True, seed=11)
    return paths


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral", "qwen3_moe"])
def test_every_family_keeps_its_outputs(family_paths, family):
    with LLM(family_paths[family], **ENGINE) as llm:
        _, plain, plain_cached = multi_turn(llm, turns=2)
    with LLM(family_paths[family], **ENGINE, **HOST) as llm:
        _, offloaded, cached = multi_turn(llm, turns=2)
        assert llm.stats()["kv_offload_blocks_loaded"] > 0
    assert offloaded == plain and sum(cached) > sum(plain_cached)


def test_float8_pool_keeps_its_outputs(model_paths):
    with LLM(model_paths["gqa_tied"], **ENGINE, kv_cache_dtype="fp8") as llm:
        plain = multi_turn(llm)
    with LLM(model_paths["gqa_tied"], **ENGINE, **HOST, kv_cache_dtype="fp8") as llm:
        offloaded = multi_turn(llm)
        assert llm.stats()["kv_offload_blocks_loaded"] > 0
    assert offloaded[1] == plain[1] and sum(offloaded[2]) > sum(plain[2])


@pytest.mark.skipif((torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1) < 2,
                    reason="needs 2 devices (GPUs, or CPU cores when there is no GPU)")
def test_two_ranks_offload_their_shards(model_paths, reference):
    with LLM(model_paths["gqa_tied"], **ENGINE, **HOST, tensor_parallel_size=2) as llm:
        _, replies, cached = multi_turn(llm)
        assert llm.stats()["kv_offload_blocks_loaded"] > 0
    assert replies == reference[1] and sum(cached) > sum(reference[2])


# ---- arguments ---------------------------------------------------------------------------------

def test_bad_sizes_are_named(model_paths):
    path = model_paths["gqa_tied"]
    with pytest.raises(ValueError, match="kv_offload_gib=1000000 does not fit in host memory"):
        Config(path, kv_offload_gib=1_000_000)
    with pytest.raises(ValueError, match="kv_offload_gib must be >= 0.0"):
        Config(path, kv_offload_gib=-1)
    with pytest.raises(TypeError, match="kv_offload_gib must be a number"):
        Config(path, kv_offload_gib="4")
    with pytest.raises(ValueError, match="kv_offload_gib .* needs enable_prefix_caching"):
        Config(path, kv_offload_gib=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gib=1e-09 holds no KV block"):
        LLM(path, **ENGINE, kv_offload_gib=1e-9)


def test_server_flag():
    assert parse_args(["--kv-offload-gib", "64"])[1] == {"kv_offload_gib": 64.0}
