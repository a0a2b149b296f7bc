"""Token embedding and LM head, both split over tensor-parallel ranks by vocabulary rows."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.all_reduce import tensor_parallel_all_reduce
from nanovllm.layers.linear import tp_group, tp_rank_and_size
from nanovllm.layers.parallel_state import parallel_state


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.tp_group = tp_group()
        state = parallel_state()
        self.tp_root = state.global_rank(state.stage, 0)     # the stage's tp rank 0 gathers the logits
        self.num_embeddings = num_embeddings
        shard = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * shard
        self.vocab_end = min(self.vocab_start + shard, num_embeddings)
        self.weight = nn.Parameter(torch.empty(shard, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start:self.vocab_end])
        param.data[rows:].zero_()   # padding rows of the last shard

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        y = F.embedding((token_ids - self.vocab_start) * mine, self.weight) * mine.unsqueeze(1)
        return tensor_parallel_all_reduce(y, self.tp_group)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor, gather: bool = True) -> torch.Tensor | None:
        """Logits over the whole vocabulary on the stage's tp rank 0, None on its other ranks; or,
        without `gather`, each rank's own shard (its ids vocab_start.., then padding columns past the
        vocabulary on the last one) for sampling there (sample/shard_sampler.py)."""
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1 or not gather:
            return logits
        shards = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, shards, dst=self.tp_root, group=self.tp_group)
        return torch.cat(shards, dim=-1)[:, :self.num_embeddings] if self.tp_rank == 0 else None
