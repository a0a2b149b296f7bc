"""Tiny random Qwen3 checkpoints built offline, and a plain transformers greedy loop to judge by."""
import gc
import json
import os
import random
import socket

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on the CPU; the flag is read when kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.checkpoints.random_checkpoint import write_tiny_model

# Two shapes: grouped-query attention with tied embeddings (sharded, old-style config.json), and
# multi-head attention with untied embeddings and a head_dim that differs from hidden/heads.
MODEL_SHAPES = {
    "gqa_tied": dict(seed=1, max_shard_bytes=60_000),
    "mha_untied": dict(seed=2, tie_word_embeddings=False, hidden_size=96, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=32),
}


def _write_old_style_config(path: str) -> None:
    """Rewrite config.json the way pre-5 transformers did (rope_theta, torch_dtype)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["torch_dtype"] = config.pop("dtype")
    with open(file, "w") as f:
        json.dump(config, f, indent=2)


@pytest.fixture(autouse=True)
def free_device_memory():
    """Engines hold reference cycles (weight loaders are bound methods); free their GPU memory now,
    because the next engine sizes its KV pool from what is free."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for name, args in MODEL_SHAPES.items():
        path = str(tmp_path_factory.mktemp(name))
        write_tiny_model(path, **args)
        if name == "gqa_tied":
            _write_old_style_config(path)
        paths[name] = path
    return paths


@pytest.fixture(params=list(MODEL_SHAPES))
def model_path(request, model_paths) -> str:
    return model_paths[request.param]


@pytest.fixture(scope="session")
def hf_model_cache():
    return {}


@pytest.fixture
def hf_greedy(hf_model_cache):
    """Greedy continuation by a plain transformers loop (full recompute each step, no cache)."""
    from transformers import AutoModelForCausalLM

    def run(path: str, prompt: list[int], num_tokens: int, banned: list[int] = ()) -> list[int]:
        if path not in hf_model_cache:
            hf_model_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model = hf_model_cache[path]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(num_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                logits[list(banned)] = float("-inf")
                ids.append(int(logits.argmax()))
        return ids[len(prompt):]

    return run


def mixed_prompts(vocab_size: int, lengths=(1, 3, 17, 40, 100, 7, 33, 64, 16, 2), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def child_pids(pid: int) -> set[int]:
    """Every descendant of pid, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port() -> int:
    """A free port below Linux's ephemeral range, which every connection's local port and every bind
    to port 0 draw from: no other process takes it before a server binds it. Drawn from the system's
    randomness, not the seedable module state, so that two test workers do not draw alike."""
    low = 32768     # the range's default start
    if os.path.exists(EPHEMERAL_PORTS):
        with open(EPHEMERAL_PORTS) as f:
            low = int(f.read().split()[0])
    while True:
        port = random.SystemRandom().randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
