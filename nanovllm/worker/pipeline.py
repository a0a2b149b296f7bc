"""What passes between pipeline stages in one step, by point-to-point send/recv (gloo on CPU, NCCL
on GPU): a stage's hidden states and residual to the next stage's rank of the same tp rank, and the
last stage's logits of the sampled rows back to rank 0, which samples as without stages.

Both ends know every shape from the step's inputs (tokens, sampled rows) and the model's config, so
only the tensors travel. Sending the logits back costs one [sampled rows, vocabulary] transfer per
step (a decode batch of 256 over a 152k vocabulary in bfloat16: 78 MB); in exchange sampling, its
tensors, grammar masks and logprobs stay on rank 0 exactly as they are without stages, so greedy
tokens and logprobs are those of one stage.

Several steps are in flight at once (one per stage), so rank 0 posts the receive of a step's logits
as soon as its own stage has sent the step on, and waits for it only when the step is collected:
meanwhile it runs the first stage of the next steps, and the last stage's send never waits for
rank 0's host. Messages between two ranks arrive in the order they were sent, and every rank runs
the steps in the order rank 0 launched them, so each posted receive gets its own step's logits.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist


def send_activations(hidden_states: torch.Tensor, residual: torch.Tensor, dst: int) -> None:
    dist.send(torch.stack((hidden_states, residual)), dst)   # one message: [2, tokens, hidden]


def receive_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                        src: int) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(both, src)
    return both[0], both[1]


def send_logits(logits: torch.Tensor, dst: int) -> None:
    dist.send(logits.contiguous(), dst)


@dataclass(slots=True)
class IncomingLogits:
    """A step's logits on their way from the last stage to rank 0: the receive is posted, `wait`
    gives them once they are in (on a GPU, once the current stream has waited for them)."""
    logits: torch.Tensor
    work: dist.Work | None      # None: the step has no logits rows, nothing is sent

    @property
    def completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.logits


def post_logits_receive(num_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
                        src: int) -> IncomingLogits:
    logits = torch.empty(num_rows, vocab_size, dtype=dtype, device=device)
    return IncomingLogits(logits, dist.irecv(logits, src) if num_rows else None)
