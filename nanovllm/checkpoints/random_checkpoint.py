"""Checkpoints with random weights, built offline: the demo model, the test models, and full-size
shapes for benchmarks (throughput does not depend on the weight values). Any family transformers
knows: the config comes from its own config class (picked by `architectures`), the parameter names
and shapes from its own model class, built on the meta device.

Weights are drawn so that a random model still behaves like a trained one where it matters for
testing: projections keep activations at unit scale, norm weights are far from 1 (a misplaced
norm changes the output), and the logits are spread out (greedy choices are not near-ties).
"""
import copy
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from nanovllm.models.registry import REFERENCE_ARCHITECTURE

# q/k projection gain of shallow models without q/k norm: as sharp as the q/k norm gain makes the others
QK_GAIN = 2.5
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = """
An inference engine turns a trained language model into answers. It keeps the keys and values of
every token it has seen in a cache split into fixed-size blocks, so that many requests can share
the memory of one device. Requests that begin with the same words share the same blocks. When a
request finishes, its blocks wait in a list until another request needs them or the memory is
taken for something new. The scheduler decides at every step which requests run: new prompts are
read in large pieces, and running requests each add one token. The numbers 0 1 2 3 4 5 6 7 8 9
and the letters of the alphabet, upper and lower case, all appear here: ABCDEFGHIJKLMNOPQRSTUVWXYZ
abcdefghijklmnopqrstuvwxyz. Introduce yourself. List all prime numbers within 100. What is the
capital of France? Paris is the capital of France. Tell me a story about a small robot who learns
to read.
"""


def config_from_dict(values: dict) -> PretrainedConfig:
    """A config of the family that `architectures` (or `model_type`) names, as config.json would load."""
    values = copy.deepcopy(values)   # transformers writes into nested dicts such as rope_scaling
    model_type = values.pop("model_type", None)
    if model_type is None:
        architecture = (values.get("architectures") or [None])[0]
        types = [t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture]
        if not types:
            raise ValueError(f"architectures: transformers knows no causal LM named {architecture!r}")
        model_type = types[0]
    return AutoConfig.for_model(model_type, **values)


def tiny_config(vocab_size: int, architecture: str = REFERENCE_ARCHITECTURE, **overrides) -> PretrainedConfig:
    """A model small enough for a CPU test: grouped-query attention and tied embeddings by default."""
    args = dict(architectures=[architecture], vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
                bos_token_id=0, eos_token_id=2, pad_token_id=0)
    args.update(overrides)
    return config_from_dict(args)


def write_demo_tokenizer(path: str, vocab_size: int = 500):
    """Train a byte-level BPE tokenizer on a paragraph of text; ids 0-2 are the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def random_tensors(config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, random tensor) for every weight of the family's model class, one at a time."""
    with torch.device("meta"):
        shapes = per_expert_shapes({name: p.shape for name, p in AutoModelForCausalLM.from_config(config).named_parameters()})
    qk_norm = any(name.endswith("q_norm.weight") for name in shapes)
    generator = torch.Generator(device).manual_seed(seed)
    for name, shape in shapes.items():
        yield name, _random_weight(name, shape, generator, device, config.num_hidden_layers, qk_norm).to(dtype)


def write_random_checkpoint(path: str, config: PretrainedConfig, seed: int = 0, dtype: torch.dtype | None = None,
                            max_shard_bytes: int = 4 << 30, device: str = "cpu") -> None:
    """Write config.json and random safetensors shards (with an index when there are several)."""
    os.makedirs(path, exist_ok=True)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    config.dtype = dtype
    config.save_pretrained(path)
    shards, shard, shard_bytes = [], {}, 0
    for name, tensor in random_tensors(config, seed, dtype, device):
        tensor = tensor.cpu()
        if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append(shard)
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += tensor.nbytes
    shards.append(shard)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def per_expert_shapes(shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """transformers 5 keeps a layer's experts fused (gate_up_proj [E, 2 * I, H], down_proj [E, H, I]);
    published checkpoints store each expert apart, so the random ones do too."""
    split = {}
    for name, shape in shapes.items():
        prefix, _, fused = name.rpartition(".")
        if not prefix.endswith(".experts") or fused not in ("gate_up_proj", "down_proj"):
            split[name] = shape
            continue
        for e in range(shape[0]):
            if fused == "down_proj":
                split[f"{prefix}.{e}.down_proj.weight"] = shape[1:]
            else:
                half = torch.Size([shape[1] // 2, shape[2]])
                split[f"{prefix}.{e}.gate_proj.weight"] = split[f"{prefix}.{e}.up_proj.weight"] = half
    return split


def _random_weight(name: str, shape: torch.Size, generator: torch.Generator, device: str,
                   num_layers: int, qk_norm: bool) -> torch.Tensor:
    # Sharp attention (large q/k norm weights, or larger q/k projections where a family has no q/k
    # norm) and layer outputs that dominate the residual keep a random model from settling into
    # repeating one token, which would make greedy tests weak.
    # Deep models (the benchmark shapes) stay tame instead: sharp attention over many layers turns
    # chaotic, and bf16 rounding alone then flips their logits (relative error ~1 against float32).
    shallow = num_layers <= 4
    if name.endswith("norm.weight"):
        w = torch.rand(shape, generator=generator, device=device) + 0.5          # in [0.5, 1.5)
        return w * 2.5 if shallow and ("q_norm" in name or "k_norm" in name) else w
    w = torch.randn(shape, generator=generator, device=device)
    if name.endswith(".bias"):
        return w * 0.5
    if "embed_tokens" in name:
        return w * 0.3
    residual_gain = 3.0 / max(1.0, num_layers / 2) ** 0.5
    sharp_qk = shallow and not qk_norm and ("q_proj" in name or "k_proj" in name)
    gain = residual_gain if "o_proj" in name or "down_proj" in name else 2.0 if "lm_head" in name else \
        QK_GAIN if sharp_qk else 1.0
    return w * gain / shape[-1] ** 0.5


def write_tiny_model(path: str, seed: int = 0, max_shard_bytes: int = 4 << 30,
                     architecture: str = REFERENCE_ARCHITECTURE, **config_overrides) -> str:
    """Tokenizer plus a tiny random model of `architecture` in float32: the demo and the test models."""
    tokenizer = write_demo_tokenizer(path)
    config = tiny_config(len(tokenizer), architecture, **config_overrides)
    write_random_checkpoint(path, config, seed=seed, dtype=torch.float32, max_shard_bytes=max_shard_bytes)
    return path


def cached_random_checkpoint(config_file: str) -> str:
    """A bfloat16 random checkpoint of the shape in config_file, written once to the temp dir."""
    path = _cache_dir(config_file, "nanovllm-random-")
    if not os.path.isfile(os.path.join(path, "complete")):
        print(f"Writing random weights of the shape in {config_file} to {path} ...")
        write_demo_tokenizer(path)
        write_random_checkpoint(path, _read_config(config_file), dtype=torch.bfloat16,
                                device="cuda" if torch.cuda.is_available() else "cpu")
        open(os.path.join(path, "complete"), "w").close()
    return path


def write_word_tokenizer(path: str, vocab_size: int):
    """A tokenizer in which every id is a word ("w0" ... ), so that any generated id shows as text,
    as nearly every id of a real vocabulary does: streamed benchmarks then send a chunk per token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)


def write_text_piece_tokenizer(path: str, eos_token_id: int, seed: int = 0):
    """A byte-level tokenizer whose ids look like a real vocabulary's: the 256 bytes, then random
    words (with and without a leading space), numbers and punctuation runs, then the special tokens,
    the last of them (end of turn) at eos_token_id. Grammars (JSON, regex) can be written with it, and
    their token masks cost what a real vocabulary's would. It has no merges: text encodes to bytes."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet)
    space = "\u0120"                              # the byte-level spelling of " "
    rng = random.Random(seed)
    pieces = dict.fromkeys(byte_chars)
    letters, punctuation = "abcdefghijklmnopqrstuvwxyz", '{}[]",:.-_()!?;\'/'
    num_regular = eos_token_id + 1 - len(SPECIAL_TOKENS)
    while len(pieces) < num_regular:
        kind = rng.random()
        if kind < 0.8:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            piece = (space if rng.random() < 0.5 else "") + (word.capitalize() if rng.random() < 0.15 else word)
        elif kind < 0.9:
            piece = (space if rng.random() < 0.3 else "") + str(rng.randrange(10 ** rng.randint(1, 4)))
        else:
            piece = (space if rng.random() < 0.3 else "") + "".join(rng.choice(punctuation)
                                                                     for _ in range(rng.randint(2, 3)))
        pieces.setdefault(piece)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def cached_shape(config_file: str, text_pieces: bool = False) -> str:
    """config.json (bfloat16) and a tokenizer of the shape in config_file, without weights: a model
    directory for `load_format="dummy"`, which draws the weights on the device instead of reading them.
    The tokenizer has a word per id, or with text_pieces, pieces of text (write_text_piece_tokenizer)."""
    path = _cache_dir(config_file, "nanovllm-shape-text-" if text_pieces else "nanovllm-shape-")
    if not os.path.isfile(os.path.join(path, "complete")):
        config = _read_config(config_file)
        if text_pieces:
            eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
            write_text_piece_tokenizer(path, eos)
        else:
            write_word_tokenizer(path, config.vocab_size)
        config.dtype = torch.bfloat16
        config.save_pretrained(path)
        open(os.path.join(path, "complete"), "w").close()
    return path


def _cache_dir(config_file: str, prefix: str) -> str:
    with open(config_file) as f:
        digest = hashlib.sha1(f.read().encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), prefix + digest)


def _read_config(config_file: str) -> PretrainedConfig:
    with open(config_file) as f:
        return config_from_dict(json.load(f))
