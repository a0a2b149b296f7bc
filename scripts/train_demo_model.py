"""Train the demo model shipped in nanovllm/demo: a small Qwen3 that adds numbers and names capitals.

    python scripts/train_demo_model.py --out nanovllm/demo        # the shipped model: 7 minutes on one H100
    python scripts/train_demo_model.py --out /tmp/demo --steps 30 --batch-size 64 --eval-every 10   # a CPU check

The data is generated chat conversations: `What is A + B?` (0 <= A, B <= 999) answered with the
sum, `What is the capital of C?` answered with the capital from capitals.tsv, and a few paraphrases
of each. The loss covers only the answer tokens. Addition pairs held out for evaluation are drawn
from the seed (`held_out_pairs`) and never trained on. The output is a standard Hugging Face
checkpoint (16-bit safetensors, config, generation config, tokenizer with the chat template) that
transformers and nanovllm both load; training.json beside it records the arguments and results.
"""
import argparse
import json
import math
import os
import random
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CAPITALS_FILE = Path(__file__).resolve().parent.parent / "nanovllm" / "demo" / "capitals.tsv"
MAX_OPERAND = 999
NUM_HELD_OUT = 2000
DEFAULT_SEED = 0
# The first form of each question is the one the tests and the example ask.
ADDITION_QUESTIONS = ["What is {a} + {b}?", "What's {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.",
                      "What is the sum of {a} and {b}?", "Calculate {a} + {b}."]
CAPITAL_QUESTIONS = ["What is the capital of {c}?", "What's the capital of {c}?", "Which city is the capital of {c}?",
                     "Name the capital of {c}.", "What is the capital city of {c}?"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's chat layout (without its tool and thinking parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def held_out_pairs(seed: int = DEFAULT_SEED) -> list[tuple[int, int]]:
    """The addition pairs (a, b) kept out of training for evaluation, in a fixed order."""
    n = MAX_OPERAND + 1
    picks = random.Random(f"held-out-{seed}").sample(range(n * n), NUM_HELD_OUT)
    return [(i // n, i % n) for i in picks]


def read_capitals(path: str | Path = CAPITALS_FILE) -> list[tuple[str, str]]:
    """(country, capital) rows of the tab-separated table, header skipped."""
    with open(path, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return [(country, capital) for country, capital in rows[1:]]


def chat_prompt(question: str) -> str:
    """The text CHAT_TEMPLATE makes of one user question with the generation prompt."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def sample_operand(rng: random.Random) -> int:
    # Half uniform over 0..999, half with a uniform digit count, so short numbers are not rare.
    if rng.random() < 0.5:
        return rng.randint(0, MAX_OPERAND)
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


class ConversationSampler:
    """Random (question, answer) pairs: additions outside the held-out set, and capitals."""

    def __init__(self, seed: int, capitals: list[tuple[str, str]], capital_share: float):
        self.rng = random.Random(f"train-{seed}")
        self.held_out = set(held_out_pairs(seed))
        self.capitals = capitals
        self.capital_share = capital_share

    def sample(self) -> tuple[str, str]:
        rng = self.rng
        if rng.random() < self.capital_share:
            country, capital = rng.choice(self.capitals)
            return rng.choice(CAPITAL_QUESTIONS).format(c=country), capital
        while True:
            a, b = sample_operand(rng), sample_operand(rng)
            if (a, b) not in self.held_out:
                return rng.choice(ADDITION_QUESTIONS).format(a=a, b=b), str(a + b)


def build_tokenizer(capitals: list[tuple[str, str]], vocab_size: int):
    """Byte-level BPE whose digits are always single tokens, with Qwen3's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # Digits split first, one per token: place value is then one position per digit for the model.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = [chat_prompt(q.format(c=country)) + capital + "<|im_end|>\n"
              for country, capital in capitals for q in CAPITAL_QUESTIONS]
    corpus += [chat_prompt(q.format(a=rng.randint(0, 999), b=rng.randint(0, 999))) + "<|im_end|>\n"
               for q in ADDITION_QUESTIONS for _ in range(20)]
    corpus += ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


class PieceEncoder:
    """Token ids of a chat text from cached encodings of its pieces. Digits and special tokens always
    stand alone in this tokenizer, so a text's ids are those of the pieces between them, in order
    (main() checks this against the tokenizer); encoding millions of questions is then cheap."""

    SEPARATORS = re.compile(r"(\d|<\|im_start\|>|<\|im_end\|>)")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = []
        for piece in self.SEPARATORS.split(text):
            if piece not in self.cache:
                self.cache[piece] = self.tokenizer.encode(piece, add_special_tokens=False)
            ids += self.cache[piece]
        return ids


def encode_batch(encode: PieceEncoder, conversations: list[tuple[str, str]], device: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids (right-padded) and next-token targets that are -100 except on the answer and its <|im_end|>."""
    prompts = [encode(chat_prompt(q)) for q, _ in conversations]
    answers = [encode(a + "<|im_end|>") for _, a in conversations]
    length = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids, targets = [], []
    for p, a in zip(prompts, answers):
        padding = length - len(p) - len(a)
        ids.append(p + a + [encode.tokenizer.pad_token_id] * padding)
        targets.append([-100] * (len(p) - 1) + a + [-100] * (padding + 1))
    return torch.tensor(ids, device=device), torch.tensor(targets, device=device)


@torch.no_grad()
def greedy_answers(model, tokenizer, questions: list[str], max_new_tokens: int = 8, batch_size: int = 512) -> list[str]:
    """Greedy answers by full recomputation; prompts of one length are batched together, so no padding."""
    device = next(model.parameters()).device
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = tokenizer([chat_prompt(q) for q in questions], add_special_tokens=False)["input_ids"]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    answers = [""] * len(questions)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            ids = torch.tensor([prompts[i] for i in chunk], device=device)
            prompt_len = ids.shape[1]
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                next_ids = model(ids).logits[:, -1].argmax(-1)
                ids = torch.cat([ids, next_ids[:, None]], dim=1)
                done |= next_ids == eos
                if done.all():
                    break
            for row, i in enumerate(chunk):
                generated = ids[row, prompt_len:].tolist()
                if eos in generated:
                    answers[i] = tokenizer.decode(generated[:generated.index(eos)])
                else:
                    answers[i] = tokenizer.decode(generated) + " <no eos>"
    return answers


def evaluate(model, tokenizer, seed: int, capitals: list[tuple[str, str]], num_additions: int) -> dict[str, float]:
    """Exact-answer accuracy on held-out additions (plain and paraphrased questions) and on every capital."""
    model.eval()
    pairs = held_out_pairs(seed)[:num_additions]
    plain = greedy_answers(model, tokenizer, [ADDITION_QUESTIONS[0].format(a=a, b=b) for a, b in pairs])
    rng = random.Random(1)
    paraphrased = greedy_answers(model, tokenizer, [rng.choice(ADDITION_QUESTIONS).format(a=a, b=b) for a, b in pairs])
    capital_questions = [q.format(c=country) for country, _ in capitals for q in CAPITAL_QUESTIONS]
    capital_answers = greedy_answers(model, tokenizer, capital_questions)
    expected_capitals = [capital for _, capital in capitals for _ in CAPITAL_QUESTIONS]
    model.train()
    return {
        "held_out_addition_accuracy": sum(x == str(a + b) for x, (a, b) in zip(plain, pairs)) / len(pairs),
        "held_out_paraphrased_addition_accuracy":
            sum(x == str(a + b) for x, (a, b) in zip(paraphrased, pairs)) / len(pairs),
        "capital_accuracy": sum(x == c for x, c in zip(capital_answers, expected_capitals)) / len(capital_questions),
    }


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the checkpoint")
    parser.add_argument("--capitals", default=str(CAPITALS_FILE), help="country<TAB>capital table")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--steps", type=int, default=5686)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--capital-share", type=float, default=0.1, help="share of capital questions in the data")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=2000)
    parser.add_argument("--eval-additions", type=int, default=500, help="held-out additions checked during training")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: after the first 70 steps, lower --steps to what fits (the schedule is "
                             "still in warmup then, so rerunning with the printed --steps reproduces the run)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype of the saved weights")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    started = time.perf_counter()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    capitals = read_capitals(args.capitals)
    tokenizer = build_tokenizer(capitals, args.vocab_size)
    question = ADDITION_QUESTIONS[0].format(a=12, b=345)
    assert tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True) == chat_prompt(question)
    assert [tokenizer.decode([t]) for t in tokenizer.encode("12 + 345")[-3:]] == ["3", "4", "5"]
    encode = PieceEncoder(tokenizer)
    sampler = ConversationSampler(args.seed + 1, capitals, 0.5)
    for question, answer in (sampler.sample() for _ in range(2000)):
        text = chat_prompt(question) + answer + "<|im_end|>"
        assert encode(text) == tokenizer.encode(text, add_special_tokens=False), text

    eos_id, pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    head_dim = 32
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden_size // head_dim,
        num_key_value_heads=args.hidden_size // head_dim // 2, head_dim=head_dim, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, device {device}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), fused=device == "cuda")
    sampler = ConversationSampler(args.seed, capitals, args.capital_share)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    log, running_loss = [], None
    model.train()
    step, timed_from = 0, None
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        ids, targets = encode_batch(encode, [sampler.sample() for _ in range(args.batch_size)], device)
        with autocast:
            logits = model(ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step in (20, 70) and args.time_limit is not None:
            if device == "cuda":
                torch.cuda.synchronize()
            timed_from = timed_from if step == 70 else time.perf_counter()
        if step == 70 and args.time_limit is not None:
            seconds_per_step = (time.perf_counter() - timed_from) / 50
            affordable = step + 1 + int((args.time_limit - (time.perf_counter() - started)) / seconds_per_step)
            if affordable < args.steps:
                args.steps = max(affordable, step + 1)
                print(f"{seconds_per_step * 1e3:.1f} ms per step: training for --steps {args.steps}", flush=True)
        if step % 100 == 0 or step == args.steps - 1:
            value = loss.item()
            running_loss = value if running_loss is None else 0.9 * running_loss + 0.1 * value
            print(f"step {step:6d}  loss {value:.4f}  (smoothed {running_loss:.4f})  lr {group['lr']:.2e}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            with autocast:
                scores = evaluate(model, tokenizer, args.seed, capitals, args.eval_additions)
            log.append({"step": step + 1, "loss": running_loss, **scores})
            print(f"step {step + 1:6d}  " + "  ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
        step += 1
    train_seconds = time.perf_counter() - started

    os.makedirs(args.out, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id],
                                               pad_token_id=pad_id, do_sample=False)
    model.to(getattr(torch, args.dtype)).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # The final numbers come from the saved 16-bit checkpoint, read back as transformers reads it.
    saved = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(device)
    final = evaluate(saved, tokenizer, args.seed, capitals, NUM_HELD_OUT)
    print("final (saved checkpoint, float32, all held-out pairs): "
          + "  ".join(f"{k} {v:.4f}" for k, v in final.items()), flush=True)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    record = {"arguments": {k: v for k, v in vars(args).items() if k not in ("out", "capitals")}, "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "parameters": num_params, "train_seconds": round(train_seconds, 1),
              "files_bytes": size, "final": final, "log": log}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"saved to {args.out}: {size / 1e6:.1f} MB, trained in {train_seconds:.0f}s", flush=True)


if __name__ == "__main__":
    main()
