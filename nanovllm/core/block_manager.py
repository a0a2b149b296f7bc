"""Paged KV blocks: allocation, reference counts, and a hash-chained prefix cache with LRU eviction.

A block is identified by a hash chained over every token up to its end, so two sequences share a
block only when their whole prefixes agree. Freed blocks keep their contents and wait in an LRU
list; a later request with the same prefix revives them instead of recomputing.

With a host tier (num_host_blocks > 0, engine/host_block_pool.py) an evicted cached block is first
recorded for a copy to host memory, and a prefix block found only there is recorded for a copy back
into a fresh GPU block; the step that follows carries these copies to the device (take_block_transfers).
"""
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import xxhash

from nanovllm.core.host_block_pool import HostBlockPool
from nanovllm.core.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None           # set once the block is full and its K/V are computed
    token_ids: tuple[int, ...] = ()   # confirms a hash hit
    stale: bool = False               # in use when the prefix cache was reset (new weights): never cached


@dataclass(frozen=True, slots=True)
class HostHit:
    """A prefix block found in the host tier only: it is copied back into a fresh GPU block."""
    host_block_id: int


def chain_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty_blocks: deque[int] = deque(range(num_blocks))      # hold nothing worth keeping
        self.evictable_blocks: OrderedDict[int, None] = OrderedDict()  # freed cached blocks, LRU first
        self.hash_to_block: dict[int, int] = {}
        self.host = HostBlockPool(num_host_blocks) if num_host_blocks else None
        # copies for the next step, in the order recorded: (GPU block, host block) offloads and
        # (host block, GPU block) loads; then those the last step took (reset forgets what they wrote)
        self.pending_offloads: list[tuple[int, int]] = []
        self.pending_loads: list[tuple[int, int]] = []
        self.sent_offloads: list[tuple[int, int]] = []
        self.sent_loads: list[tuple[int, int]] = []
        self.num_offloaded_blocks = self.num_loaded_blocks = 0      # cumulative, for metrics

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty_blocks) + len(self.evictable_blocks)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - self.num_free_blocks

    def block_hashes(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """The chained hash of each full block among seq's first num_tokens tokens (all by default;
        computed once, grown as blocks fill). The engine passes known tokens only: a sequence's
        last token may still be pending on the device."""
        size = self.block_size
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        for i in range(len(seq.block_hashes), num_tokens // size):
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(prev, seq.token_ids[i * size:(i + 1) * size]))
        return seq.block_hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int | HostHit]:
        """Cached blocks holding seq's leading full blocks (GPU block ids, or HostHit where only the
        host tier has one); the last token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        hashes = self.block_hashes(seq, seq.num_tokens - 1)
        hits = []
        for i in range((seq.num_tokens - 1) // size):
            token_ids = tuple(seq.token_ids[i * size:(i + 1) * size])
            block_id = self.hash_to_block.get(hashes[i])
            if block_id is not None and self.blocks[block_id].token_ids == token_ids:
                hits.append(block_id)
            elif self.host is not None and (host_block_id := self.host.find(hashes[i], token_ids)) is not None:
                hits.append(HostHit(host_block_id))
            else:
                break
        return hits

    @staticmethod
    def num_host_hits(cached_prefix: list[int | HostHit]) -> int:
        return sum(1 for b in cached_prefix if isinstance(b, HostHit))

    def num_blocks_needed(self, seq: Sequence, num_tokens: int, cached_prefix: list[int | HostHit] = ()) -> int:
        """Free blocks taken if seq's block table grows to cover num_tokens (reviving cached_prefix,
        and one fresh block for each of its host hits)."""
        revived = sum(1 for b in cached_prefix if isinstance(b, HostHit) or self.blocks[b].ref_count == 0) \
            if cached_prefix else 0
        covered = len(seq.block_table) + len(cached_prefix)
        return revived + max(0, -(-num_tokens // self.block_size) - covered)

    def can_allocate(self, seq: Sequence, num_tokens: int, cached_prefix: list[int | HostHit] = ()) -> bool:
        return self.num_blocks_needed(seq, num_tokens, cached_prefix) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, cached_prefix: list[int | HostHit] = ()) -> None:
        """Attach cached_prefix to seq, then grow its block table to cover num_tokens tokens."""
        # every GPU hit is revived and every host hit held before a block is taken: taking one may
        # evict, and must evict none of these
        for hit in cached_prefix:
            if isinstance(hit, HostHit):
                self.host.read(hit.host_block_id)
                continue
            block = self.blocks[hit]
            if block.ref_count == 0:
                del self.evictable_blocks[hit]        # a hit on a waiting block revives it
            block.ref_count += 1
        for hit in cached_prefix:
            seq.block_table.append(self._load(hit.host_block_id) if isinstance(hit, HostHit) else hit)
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free_block())

    def _load(self, host_block_id: int) -> int:
        """A fresh GPU block that the coming step fills from the host tier; it is cached at once."""
        block_id = self._take_free_block()
        block = self.blocks[block_id]
        block.hash, block.token_ids = self.host.block_hash[host_block_id], self.host.block_token_ids[host_block_id]
        self.hash_to_block[block.hash] = block_id
        self.pending_loads.append((host_block_id, block_id))
        return block_id

    def _take_free_block(self) -> int:
        if self.empty_blocks:
            block_id = self.empty_blocks.popleft()
        else:
            block_id, _ = self.evictable_blocks.popitem(last=False)
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.host is not None:      # keep it in host memory (copied before the slot is reused)
                    host_block_id = self.host.store(block.hash, block.token_ids)
                    if host_block_id is not None:
                        self.pending_offloads.append((block_id, host_block_id))
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        self.blocks[block_id].stale = False
        return block_id

    def take_block_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The offloads and loads recorded since the last call, for the step about to launch (the
        device makes every offload before any load, then the step's writes)."""
        offloads, loads = self.pending_offloads, self.pending_loads
        self.pending_offloads, self.pending_loads = [], []
        self.sent_offloads, self.sent_loads = offloads, loads
        self.num_offloaded_blocks += len(offloads)
        self.num_loaded_blocks += len(loads)
        if self.host is not None:
            self.host.copies_sent()
        return offloads, loads

    def cache_computed_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Publish the blocks that became full and computed since num_computed_before."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        first, last = num_computed_before // size, seq.num_computed_tokens // size
        # a sequence that lived through a prefix-cache reset computes on K/V of the old weights
        if first == last or self.blocks[seq.block_table[0]].stale:
            return
        hashes = self.block_hashes(seq, seq.num_computed_tokens)
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * size:(i + 1) * size])
                self.hash_to_block[block.hash] = block.block_id

    def fork(self, parent: Sequence) -> None:
        """A sequence forked from parent shares (a copy of) its block table: count the references."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1

    def num_shared_blocks(self, seq: Sequence, first_position: int) -> int:
        """Blocks of seq from the one holding first_position on that other sequences hold too."""
        return sum(1 for b in seq.block_table[first_position // self.block_size:] if self.blocks[b].ref_count > 1)

    def copy_on_write(self, seq: Sequence, first_position: int) -> list[tuple[int, int]]:
        """Give seq its own copy of each shared block it will write (from first_position on);
        returns the (source, destination) block copies the device must make before the step."""
        copies = []
        for i in range(first_position // self.block_size, len(seq.block_table)):
            block = self.blocks[seq.block_table[i]]
            if block.ref_count > 1:
                block.ref_count -= 1
                seq.block_table[i] = self._take_free_block()
                copies.append((block.block_id, seq.block_table[i]))
        return copies

    def free_beyond(self, seq: Sequence, num_tokens: int) -> None:
        """Return the blocks of seq's table past its first num_tokens tokens (reserved for proposals
        that were rejected; what they hold is never read)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:       # a block past the end is never full, so never cached
                self.empty_blocks.append(block.block_id)

    def free(self, seq: Sequence) -> None:
        # Tail blocks are released first so they are evicted before the shared-looking head blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable_blocks[block_id] = None
                else:
                    self.empty_blocks.append(block_id)
        seq.block_table.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, on the GPU and in the host tier (the weights changed, so their
        K/V are stale). Called between steps. Blocks in use stay with their sequences but are no
        longer found, and are marked stale: their sequences publish no block from now on, since every
        later block of theirs is computed over the old K/V."""
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
            block.stale = block.ref_count > 0
        self.hash_to_block.clear()
        self.empty_blocks.extend(self.evictable_blocks)
        self.evictable_blocks.clear()
        if self.host is not None:
            for host_block_id in list(self.host.lru):
                self.host.drop(host_block_id)

    def reset(self) -> None:
        """Every block is free again (the engine dropped its sequences' blocks after an interrupted
        step). Cached blocks keep their contents and stay findable; the rest become empty. Blocks
        that copies of the last step (or of one never launched) were to fill are forgotten: those
        copies may not have run."""
        if self.host is not None:
            for _, host_block_id in self.pending_offloads + self.sent_offloads:
                self.host.drop(host_block_id)
            for _, block_id in self.pending_loads + self.sent_loads:
                self.blocks[block_id].hash, self.blocks[block_id].token_ids = None, ()
            self.host.copies_sent()
        self.pending_offloads, self.pending_loads, self.sent_offloads, self.sent_loads = [], [], [], []
        for block in self.blocks:
            block.ref_count = 0
            if block.hash is not None and self.hash_to_block.get(block.hash) != block.block_id:
                block.hash, block.token_ids = None, ()
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.blocks[b].hash == h}
        cached = [b for b in self.evictable_blocks if self.blocks[b].hash is not None]   # LRU first
        cached += [b.block_id for b in self.blocks if b.hash is not None and b.block_id not in self.evictable_blocks]
        self.evictable_blocks = OrderedDict.fromkeys(cached)
        self.empty_blocks = deque(b.block_id for b in self.blocks if b.hash is None)
