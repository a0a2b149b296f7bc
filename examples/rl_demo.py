"""A few REINFORCE steps on the bundled demo model, on a CPU, with nanovllm as the rollout engine.

The trainer is plain torch: transformers' AutoModelForCausalLM on its own copy of the demo weights
(float32). Each step nanovllm samples answers to `What is A + B?`, the trainer scores them, takes
one policy-gradient step, and hands its state_dict to the engine with `llm.update_weights` (in
place: no new engine). The reward is checkable: 1 if the answer is the right sum, else 0. Rollouts
are sampled hot (temperature 3), where the demo model, exact at temperature 0, gets half the sums
wrong; the policy gradient (of the tempered policy that sampled them) sharpens it, and the mean
reward per step goes up.

    python examples/rl_demo.py                       # 20 steps of 128 rollouts, about a minute on 2 cores
    python examples/rl_demo.py --steps 2 --batch 8   # a quick look
    python examples/rl_demo.py --save docs/rl_demo_rewards.json --plot docs/rl_demo_reward.png
"""
import argparse
import json
import random

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo import model_path

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=16, num_kvcache_blocks=256,
                   max_num_seqs=64)


def questions(rng: random.Random, count: int) -> tuple[list[list[dict]], list[int]]:
    """`count` sum questions and their answers."""
    pairs = [(rng.randrange(1000), rng.randrange(1000)) for _ in range(count)]
    return [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in pairs], [a + b for a, b in pairs]


def reward(answer: str, expected: int) -> float:
    """1 if the answer is the right sum."""
    return 1.0 if answer.strip() == str(expected) else 0.0


def completion_logprob(model, prompt_ids: list[int], token_ids: list[int], temperature: float) -> torch.Tensor:
    """Sum of log p(token) over the completion under the trainer's model at the sampling temperature
    (the policy that drew it), with grad."""
    ids = torch.tensor([prompt_ids + token_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(token_ids)[:, None]).sum()


def train(steps: int = 20, batch: int = 128, lr: float = 3e-4, temperature: float = 3.0, seed: int = 0,
          verbose: bool = True):
    """Run the loop; returns (llm, trainer model, mean reward per step). The caller shuts llm down."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32)    # the trainer's copy
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    llm = LLM(model_path(), **ENGINE_ARGS)
    rewards = []
    try:
        for step in range(steps):
            # a seed per rollout: one seed for all would give every rollout the same noise
            params = [SamplingParams(temperature=temperature, max_tokens=8, seed=(seed * 1000 + step) * batch + i)
                      for i in range(batch)]
            conversations, answers = questions(rng, batch)
            outs = llm.chat(conversations, params, use_tqdm=False)
            scores = torch.tensor([reward(o["text"], answer) for o, answer in zip(outs, answers)])
            rewards.append(float(scores.mean()))
            if verbose:
                print(f"step {step}: mean reward {rewards[-1]:.3f}  (weight_version {outs[0]['weight_version']}, "
                      f"e.g. {outs[0]['text']!r})", flush=True)
            advantages = scores - scores.mean()
            model.train()
            optimizer.zero_grad()
            loss = sum(-a * completion_logprob(model, o["prompt_token_ids"], o["token_ids"], temperature)
                       for a, o in zip(advantages, outs) if a != 0 and o["token_ids"]) / batch
            if torch.is_tensor(loss):
                loss.backward()
                optimizer.step()
            model.eval()
            llm.update_weights(model.state_dict().items())     # in place; the next rollouts use them
    except BaseException:
        llm.shutdown()
        raise
    return llm, model, rewards


def plot(rewards: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    ax.plot(range(len(rewards)), rewards, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.set_title("REINFORCE on the demo model, rollouts from nanovllm", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128, help="rollouts per step")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--temperature", type=float, default=3.0, help="the rollouts' sampling temperature")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--save", default=None, help="write the per-step mean rewards here (JSON)")
    parser.add_argument("--plot", default=None, help="draw the reward curve here (PNG; needs matplotlib)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm, _, rewards = train(args.steps, args.batch, args.lr, args.temperature, args.seed)
    llm.shutdown()
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"steps": args.steps, "batch": args.batch, "lr": args.lr, "temperature": args.temperature,
                       "seed": args.seed, "mean_reward": rewards}, f, indent=1)
    if args.plot:
        plot(rewards, args.plot)


if __name__ == "__main__":
    main()
