"""Rollout control on the GPU (docs/rollout.md): how long `update_weights` takes for a whole model
from device tensors and from host tensors, how long sleep and wake_up take at levels 1 and 2, and
how much of the GPU memory the engine held is free while it sleeps.

    python scripts/bench_rollout.py --config configs/qwen3-8b.json

The weights are random tensors under the checkpoint's names (as a trainer's state_dict() names
them), drawn on the device in bfloat16; host copies are plain (pageable) CPU tensors, as a state
dict moved off the GPU is, and pinned ones, as a trainer that keeps its copy pinned has. Every phase is checked: the same greedy tokens after an update with the
weights the engine already holds, after level-1 sleep, and after level-2 sleep plus an update.
"""
import argparse
import time

import torch
from transformers import AutoConfig

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.bench_workload import add_model_arguments, model_engine_args
from nanovllm.checkpoints.random_checkpoint import random_tensors


def timed(label: str, action) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    action()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"{label}: {seconds:.3f} s", flush=True)
    return seconds


def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="leaves room for the device copy of the weights")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine_args = model_engine_args(args)
    torch.cuda.init()
    free_before = free_gib()
    llm = LLM(engine_args["model"], load_format=engine_args["load_format"],
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=4096)
    held = free_before - free_gib()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = [list(range(100, 164))]

    def tokens():
        return llm.generate(prompt, greedy, use_tqdm=False)[0]["token_ids"]

    config = AutoConfig.from_pretrained(engine_args["model"])
    on_device = list(random_tensors(config, seed=1, dtype=torch.bfloat16, device="cuda"))
    on_host = [(name, tensor.cpu()) for name, tensor in on_device]
    gib = sum(t.nbytes for _, t in on_device) / 2**30
    print(f"engine holds {held:.1f} GiB of the GPU; update of {len(on_device)} tensors, {gib:.2f} GiB", flush=True)

    llm.update_weights(on_device)
    expected = tokens()
    for _ in range(args.repeats):
        timed("update_weights from device tensors", lambda: llm.update_weights(on_device))
    for _ in range(args.repeats):
        timed("update_weights from host tensors", lambda: llm.update_weights(on_host))
    pinned = [(name, tensor.pin_memory()) for name, tensor in on_host]
    for _ in range(args.repeats):
        timed("update_weights from pinned host tensors", lambda: llm.update_weights(pinned))
    del pinned
    assert tokens() == expected, "an update with the same weights changed the greedy tokens"
    del on_device
    torch.cuda.empty_cache()

    for _ in range(args.repeats):
        awake = free_gib()
        timed("sleep(level=1)", lambda: llm.sleep(level=1))
        asleep = free_gib()
        print(f"  free while asleep: {asleep - awake:.1f} GiB more, {(asleep - awake) / held:.1%} of what the "
              f"engine held", flush=True)
        timed("wake_up()", llm.wake_up)
        assert tokens() == expected, "level-1 sleep changed the greedy tokens"

    for _ in range(args.repeats):
        awake = free_gib()
        timed("sleep(level=2)", lambda: llm.sleep(level=2))
        print(f"  free while asleep: {free_gib() - awake:.1f} GiB more", flush=True)
        timed("wake_up(['weights'])", lambda: llm.wake_up(["weights"]))
        timed("  update_weights from host tensors", lambda: llm.update_weights(on_host))
        timed("wake_up(['kv_cache'])", lambda: llm.wake_up(["kv_cache"]))
        assert tokens() == expected, "level-2 sleep plus an update changed the greedy tokens"
    print("greedy tokens unchanged through every phase", flush=True)


if __name__ == "__main__":
    main()
