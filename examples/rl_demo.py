"""A few REINFORCE steps on the bundled demo model, on a CPU, with nanovllm as the rollout engine.

The trainer is plain torch: transformers' AutoModelForCausalLM on its own copy of the demo weights
(float32). Each step nanovllm samples answers to `What is A + B?`, the trainer scores them, takes
one policy-gradient step, and hands its state_dict to the engine with `llm.update_weights` (in
place: no new engine). The reward is checkable: 1 if the answer starts with the target digit
(default 1), else 0; the model, trained to answer sums, learns to open with it. The mean reward
per step is printed and goes up.

    python examples/rl_demo.py                       # 8 steps, a couple of minutes on a CPU
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


def questions(rng: random.Random, count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"What is {rng.randrange(1000)} + {rng.randrange(1000)}?"}]
            for _ in range(count)]


def reward(answer: str, target: str) -> float:
    """1 if the answer opens with the target digit."""
    return 1.0 if answer.strip().startswith(target) else 0.0


def completion_logprob(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """Sum of log p(token) over the completion, under the trainer's model (with grad)."""
    ids = torch.tensor([prompt_ids + token_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(token_ids)[:, None]).sum()


def train(steps: int = 8, batch: int = 16, lr: float = 1e-3, target: str = "1", seed: int = 0,
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
            params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed * 1000 + step)
            outs = llm.chat(questions(rng, batch), params, use_tqdm=False)
            scores = torch.tensor([reward(o["text"], target) for o in outs])
            rewards.append(float(scores.mean()))
            if verbose:
                print(f"step {step}: mean reward {rewards[-1]:.3f}  (weight_version {outs[0]['weight_version']}, "
                      f"e.g. {outs[0]['text']!r})", flush=True)
            advantages = scores - scores.mean()
            model.train()
            optimizer.zero_grad()
            loss = sum(-a * completion_logprob(model, o["prompt_token_ids"], o["token_ids"])
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
    ax.set_title("REINFORCE on the demo model (examples/rl_demo.py)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="rollouts per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target", default="1", help="the digit an answer is rewarded for opening with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--save", default=None, help="write the per-step mean rewards here (JSON)")
    parser.add_argument("--plot", default=None, help="draw the reward curve here (PNG; needs matplotlib)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm, _, rewards = train(args.steps, args.batch, args.lr, args.target, args.seed)
    llm.shutdown()
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"steps": args.steps, "batch": args.batch, "lr": args.lr, "target": args.target,
                       "seed": args.seed, "mean_reward": rewards}, f, indent=1)
    if args.plot:
        plot(rewards, args.plot)


if __name__ == "__main__":
    main()
