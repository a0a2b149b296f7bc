"""BlockManager on its own: hash chaining, prefix hits, reference counts, LRU eviction. No model."""
import random
import struct

import xxhash

from nanovllm.core import block_manager as block_manager_module
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4  # tokens per block in these tests


def make_seq(token_ids: list[int]) -> Sequence:
    return Sequence(token_ids, SamplingParams())


def reference_chain(token_ids: list[int], block_size: int = BS) -> list[int]:
    """xxh64 of each full block's int64 little-endian tokens, preceded by the previous hash's 8 LE bytes."""
    hashes, prev = [], b""
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        h = xxhash.xxh64(prev + struct.pack(f"<{block_size}q", *block)).intdigest()
        hashes.append(h)
        prev = struct.pack("<Q", h)
    return hashes


def admit(bm: BlockManager, token_ids: list[int]) -> Sequence:
    """Admit a sequence the way the scheduler does, compute all its tokens, and publish its full blocks."""
    seq = make_seq(token_ids)
    prefix = bm.find_cached_prefix(seq)
    assert bm.can_allocate(seq, seq.num_tokens, prefix)
    bm.allocate(seq, seq.num_tokens, prefix)
    before = len(prefix) * bm.block_size
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq, before)
    return seq


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ---- hash chaining -----------------------------------------------------------------------------

def test_block_hashes_equal_hand_computed_chain():
    """Each full block's hash is xxh64(prev hash bytes + int64 tokens); a partial block has none yet."""
    bm = BlockManager(8, BS)
    seq = make_seq([5, 1, 2**40, 7, 0, 3, 3, 9, 11, 12])   # 2 full blocks + 2 tokens
    assert bm.block_hashes(seq) == reference_chain(seq.token_ids)
    assert len(seq.block_hashes) == 2
    seq.append_token(13)
    seq.append_token(14)                                    # third block fills
    assert bm.block_hashes(seq) == reference_chain(seq.token_ids)
    assert len(seq.block_hashes) == 3


def test_hashes_diverge_exactly_where_blocks_differ():
    """Same first block, different second: equal first hashes, different second hashes."""
    bm = BlockManager(8, BS)
    a, b = make_seq(tokens(8)), make_seq(tokens(7) + [999])
    ha, hb = bm.block_hashes(a), bm.block_hashes(b)
    assert ha[0] == hb[0]
    assert ha[1] != hb[1]


def test_change_in_first_block_changes_every_later_hash():
    """Chaining: later blocks with identical tokens still hash differently after an earlier change."""
    bm = BlockManager(8, BS)
    a = tokens(12)
    b = [999] + a[1:]
    ha, hb = bm.block_hashes(make_seq(a)), bm.block_hashes(make_seq(b))
    assert all(x != y for x, y in zip(ha, hb)) and len(ha) == 3


# ---- prefix hits ---------------------------------------------------------------------------------

def test_computed_prefix_is_found_and_other_prefixes_miss():
    """Only blocks published after compute are hits; a hit covers the matching leading blocks only."""
    bm = BlockManager(16, BS)
    a = make_seq(tokens(10))
    bm.allocate(a, 10)
    assert bm.find_cached_prefix(make_seq(tokens(10))) == []      # allocated but not yet computed
    a.num_computed_tokens = 6                                       # a chunk covering block 0 only
    bm.cache_computed_blocks(a, 0)
    assert bm.find_cached_prefix(make_seq(tokens(10))) == a.block_table[:1]
    a.num_computed_tokens = 10
    bm.cache_computed_blocks(a, 6)

    assert bm.find_cached_prefix(make_seq(tokens(8) + [1, 2, 3])) == a.block_table[:2]
    assert bm.find_cached_prefix(make_seq(tokens(5) + [1, 2, 3, 4])) == a.block_table[:1]
    assert bm.find_cached_prefix(make_seq([1] + tokens(9)[1:])) == []
    assert bm.find_cached_prefix(make_seq(tokens(12, start=500))) == []


def test_last_prompt_token_is_never_served_from_cache():
    """A prompt of exactly N full cached blocks reuses N-1 of them; one more token allows all N."""
    bm = BlockManager(16, BS)
    a = admit(bm, tokens(12))
    assert bm.find_cached_prefix(make_seq(tokens(12))) == a.block_table[:2]
    assert bm.find_cached_prefix(make_seq(tokens(12) + [7])) == a.block_table[:3]
    assert bm.find_cached_prefix(make_seq(tokens(4))) == []


def test_hash_collision_is_rejected_by_token_ids(monkeypatch):
    """With every block hashing alike, a block is reused only when its token ids match too."""
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda prev, token_ids: 42)
    bm = BlockManager(8, BS)
    a = admit(bm, [1, 2, 3, 4, 9])
    assert bm.hash_to_block == {42: a.block_table[0]}
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 5, 9])) == []
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 7])) == a.block_table[:1]


# ---- reference counts ------------------------------------------------------------------------------

def test_shared_blocks_are_counted_and_held_until_last_owner_frees():
    """Two owners -> ref_count 2; freeing one keeps them held; freeing both makes them evictable."""
    bm = BlockManager(8, BS)
    a = admit(bm, tokens(9))
    b = admit(bm, tokens(8) + [777])
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    assert bm.num_used_blocks == 4

    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert not set(shared) & set(bm.evictable_blocks)
    assert bm.num_used_blocks == 3                     # a's unshared tail is free again

    bm.free(b)
    assert [bm.blocks[i].ref_count for i in shared] == [0, 0]
    assert set(shared) <= set(bm.evictable_blocks)
    assert bm.num_used_blocks == 0


def test_no_block_is_held_after_everything_is_freed():
    """Sequences sharing, not sharing and growing all free back to an empty pool."""
    bm = BlockManager(32, BS)
    seqs = [admit(bm, tokens(n)) for n in (3, 9, 13, 16)] + [admit(bm, tokens(10, start=7))]
    seqs[1].append_token(5)
    bm.allocate(seqs[1], seqs[1].num_tokens)
    assert bm.num_used_blocks > 0
    for seq in seqs:
        bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 32
    assert all(block.ref_count == 0 for block in bm.blocks)


# ---- LRU eviction --------------------------------------------------------------------------------

def test_never_used_blocks_are_taken_before_any_cached_block_is_evicted():
    bm = BlockManager(6, BS)
    a = admit(bm, tokens(9))              # 2 cached blocks + 1 partial
    cached = set(a.block_table[:2])
    bm.free(a)
    assert set(bm.evictable_blocks) == cached
    other = make_seq(tokens(16, start=500))   # needs exactly the 4 empty blocks
    bm.allocate(other, 16)
    assert not cached & set(other.block_table)
    assert set(bm.evictable_blocks) == cached
    assert len(bm.find_cached_prefix(make_seq(tokens(9)))) == 2


def test_least_recently_freed_cached_block_is_evicted_first():
    """a is freed before b, so a's cached block goes first once the empty blocks are used up."""
    bm = BlockManager(4, BS)
    a = admit(bm, tokens(5, start=100))   # 1 cached + 1 partial block
    b = admit(bm, tokens(5, start=200))
    a_cached, b_cached = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    c = make_seq(tokens(12, start=300))   # 2 empty blocks + 1 eviction
    bm.allocate(c, 12)
    assert a_cached in c.block_table and b_cached not in c.block_table
    assert bm.find_cached_prefix(make_seq(tokens(5, start=100))) == []
    assert bm.find_cached_prefix(make_seq(tokens(5, start=200))) == [b_cached]


def test_freed_sequence_releases_tail_blocks_first_so_its_head_survives_longest():
    """free() puts a sequence's blocks into the LRU tail first, head last: the head blocks, which
    every request with the same prefix shares, are evicted last."""
    bm = BlockManager(4, BS)
    a = admit(bm, tokens(16))             # 4 full blocks, all cached
    head_to_tail = list(a.block_table)
    bm.free(a)
    assert list(bm.evictable_blocks) == head_to_tail[::-1]
    b = make_seq(tokens(4, start=500))    # evicts exactly one block: a's tail
    bm.allocate(b, 4)
    assert b.block_table == [head_to_tail[3]]
    assert bm.find_cached_prefix(make_seq(tokens(16))) == head_to_tail[:3]


def test_eviction_drops_the_hash_so_the_prefix_misses():
    bm = BlockManager(2, BS)
    a = admit(bm, tokens(5))
    evicted = a.block_table[0]
    bm.free(a)
    b = make_seq(tokens(8, start=500))    # takes the empty block, then evicts a's cached block
    bm.allocate(b, 8)
    assert evicted in b.block_table
    assert bm.blocks[evicted].hash is None and bm.hash_to_block == {}
    assert bm.find_cached_prefix(make_seq(tokens(5))) == []


def test_hit_on_freed_block_revives_it_and_counts_against_free_blocks():
    """A waiting cached block returns to ref_count 1 and leaves the LRU; can_allocate charges the
    revival as taking a free block."""
    bm = BlockManager(5, BS)
    holder = admit(bm, tokens(3, start=900))     # keeps 1 block held throughout
    a = admit(bm, tokens(9))                     # 2 cached blocks + 1 partial
    bm.free(a)
    cached = sorted(bm.evictable_blocks)
    assert bm.num_free_blocks == 4

    too_long = make_seq(tokens(8) + tokens(9, start=500))   # 2 revived + 3 new = 5 > 4 free
    prefix = bm.find_cached_prefix(too_long)
    assert sorted(prefix) == cached
    assert bm.num_blocks_needed(too_long, too_long.num_tokens, prefix) == 5
    assert not bm.can_allocate(too_long, too_long.num_tokens, prefix)

    fits = make_seq(tokens(8) + tokens(8, start=500))       # 2 revived + 2 new = 4
    prefix = bm.find_cached_prefix(fits)
    assert bm.can_allocate(fits, fits.num_tokens, prefix)
    bm.allocate(fits, fits.num_tokens, prefix)
    assert fits.block_table[:2] == prefix
    assert [bm.blocks[i].ref_count for i in cached] == [1, 1]
    assert not bm.evictable_blocks and bm.num_free_blocks == 0
    bm.free(holder)


def test_prefix_caching_disabled_never_reuses_a_block():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = admit(bm, tokens(9))
    b = admit(bm, tokens(9))                     # same prompt while a is live
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.hash_to_block == {} and not bm.evictable_blocks
    assert bm.find_cached_prefix(make_seq(tokens(9))) == []
    assert bm.num_used_blocks == 0


# ---- randomized invariants -----------------------------------------------------------------------

def check_invariants(bm: BlockManager, live: list[Sequence], kv: dict[int, tuple]) -> None:
    total = len(bm.blocks)
    empty, evictable = list(bm.empty_blocks), list(bm.evictable_blocks)
    held = [b.block_id for b in bm.blocks if b.ref_count > 0]
    assert sorted(empty + evictable + held) == list(range(total)), "each block in exactly one set"
    owners = [0] * total
    for seq in live:
        for block_id in seq.block_table:
            owners[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == owners
    assert all(bm.blocks[b].hash is not None for b in evictable)
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block.items())
    assert bm.num_free_blocks + bm.num_used_blocks == total
    assert bm.num_free_blocks == len(empty) + len(evictable)
    for seq in live:   # every computed slot holds K/V written for exactly this prefix
        for pos in range(seq.num_computed_tokens):
            slot = (seq.block_table[pos // bm.block_size], pos % bm.block_size)
            assert kv[slot] == tuple(seq.token_ids[:pos + 1])


def compute(bm: BlockManager, seq: Sequence, kv: dict[int, tuple]) -> None:
    """Write K/V (modelled as the token prefix) for seq's uncomputed tokens, then publish blocks."""
    before = seq.num_computed_tokens
    for pos in range(before, seq.num_tokens):
        kv[(seq.block_table[pos // bm.block_size], pos % bm.block_size)] = tuple(seq.token_ids[:pos + 1])
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq, before)


def test_random_operations_keep_the_pool_consistent():
    rng = random.Random(1234)
    bm = BlockManager(24, BS)
    prefixes = [[], tokens(4), tokens(8), tokens(11), tokens(8, start=300)]
    live, kv, hits = [], {}, 0
    for _ in range(400):
        op = rng.random()
        if op < 0.4 or not live:
            seq = make_seq(rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 6))])
            prefix = bm.find_cached_prefix(seq)
            if bm.can_allocate(seq, seq.num_tokens, prefix):
                bm.allocate(seq, seq.num_tokens, prefix)
                seq.num_computed_tokens = len(prefix) * BS
                hits += len(prefix)
                compute(bm, seq, kv)
                live.append(seq)
        elif op < 0.75:
            seq = rng.choice(live)
            for _ in range(rng.randint(1, 5)):
                seq.append_token(rng.randrange(3))
            if bm.can_allocate(seq, seq.num_tokens):
                bm.allocate(seq, seq.num_tokens)
                compute(bm, seq, kv)
            else:                         # like a preemption: drop it
                live.remove(seq)
                bm.free(seq)
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        check_invariants(bm, live, kv)
    assert hits > 20                      # the run exercised the cache
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [], kv)
    assert bm.num_used_blocks == 0
