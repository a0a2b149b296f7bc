"""examples/rl_demo.py for 2 steps: after its in-place updates, the engine's greedy answers equal
transformers' greedy decoding with the trainer's weights (so the weight sync is real), and differ
from the untouched demo model's somewhere or its logits moved (the trainer really changed them)."""
import importlib.util
import os

import torch

from nanovllm import SamplingParams
from nanovllm.demo import model_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_demo():
    spec = importlib.util.spec_from_file_location("rl_demo", os.path.join(REPO, "examples", "rl_demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_demo_syncs_the_trainers_weights():
    torch.set_num_threads(1)
    demo = load_demo()
    llm, model, rewards = demo.train(steps=2, batch=8, lr=3e-3, verbose=False)
    try:
        assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards)
        assert llm.engine.weight_version == 2
        from transformers import AutoModelForCausalLM
        original = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32)
        with torch.no_grad():
            moved = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), original.parameters()))
        assert moved > 1e-4                              # the trainer's weights really changed

        messages = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 34), (505, 606), (7, 8))]
        outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5), use_tqdm=False)
        with torch.no_grad():
            for out in outs:
                ids = list(out["prompt_token_ids"])
                trained_gap = untouched_gap = 0.0
                for step in out["logprobs"]:              # transformers' greedy, full recompute
                    prefix = torch.tensor([ids])
                    trained = torch.log_softmax(model(prefix).logits[0, -1], -1)
                    untouched = torch.log_softmax(original(prefix).logits[0, -1], -1)
                    ids.append(int(trained.argmax()))
                    trained_gap = max([trained_gap] + [abs(lp - float(trained[t])) for t, lp in step.items()])
                    untouched_gap = max([untouched_gap] + [abs(lp - float(untouched[t])) for t, lp in step.items()])
                assert out["token_ids"] == ids[len(out["prompt_token_ids"]):]
                assert trained_gap < 1e-3            # the engine's top-5 logprobs are the trainer's
                assert untouched_gap > 1e-2          # and not the old weights' (so the check can fail)
    finally:
        llm.shutdown()
