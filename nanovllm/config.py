"""Engine configuration: every engine argument in one place, validated once."""
import glob
import importlib.util
import os
from dataclasses import dataclass, field, fields, replace

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.models.model_config import ModelConfig
from nanovllm.models.registry import read_model_config
from nanovllm.speculative_config import SpeculativeConfig
from nanovllm.utils.hub import resolve_model
from nanovllm.utils.validation import check_int, check_number

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Config:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1       # stages of contiguous layers; world size = tensor x pipeline
    distributed_executor_backend: str = "mp"   # ranks 1.. as local processes ("mp") or Ray actors ("ray")
    max_model_len: int | None = None
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    disable_custom_all_reduce: bool = False   # True: tensor-parallel sums by NCCL only (no one-shot over symmetric memory)
    kv_cache_dtype: str = "auto"          # "auto": the model's dtype; "fp8": float8 e4m3 with scales
    load_format: str = "auto"             # "auto": the safetensors files; "dummy": random weights (benchmarks)
    speculative_config: dict | SpeculativeConfig | None = None   # e.g. {"method": "ngram", "num_speculative_tokens": 4}
    kv_offload_gib: float = 0.0           # host memory for evicted prefix-cache blocks (all ranks); 0: none
    quantization: str | None = None       # None: as the checkpoint is; "fp8": quantize a 16-bit one while loading
    scheduling_policy: str = "fcfs"       # "priority": requests by (priority, arrival); "fcfs" ignores priority
    runner: str = "generate"              # "pooling": embeddings (LLM.embed), no LM head, no sampling
    revision: str | None = None           # a Hugging Face repo id's branch, tag or commit (None: main)
    download_dir: str | None = None       # where repo ids are downloaded (None: the Hugging Face cache)
    # Derived from the arguments and the checkpoint, not passed by users.
    hf_config: PretrainedConfig = field(init=False, repr=False)
    model_config: ModelConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    eos_token_ids: tuple[int, ...] = field(init=False)

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> "Config":
        known = {f.name for f in fields(cls) if f.init} - {"model"}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known arguments: {sorted(known)}")
        return cls(model, **engine_args)

    def __post_init__(self):
        for name in ("revision", "download_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str or None, got {getattr(self, name)!r}")
        self._check_backend()
        self.model = resolve_model(str(self.model), self.revision, self.download_dir)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        self.hf_config = load_hf_config(self.model, needs_weights=self.load_format == "auto")
        if self.load_format == "dummy" and isinstance(self.quantization, str) and \
                getattr(self.hf_config, "quantization_config", None) is None:
            from nanovllm.quantization import random_weights_config   # random weights stored as that format's
            self.hf_config.quantization_config = random_weights_config(self.quantization)
        self.model_config = read_model_config(self.hf_config, self.quantization)
        self._check_device()
        if self.model_config.quantization is not None:
            self.model_config.quantization.verify(self.model_config, self.tensor_parallel_size)
        self._check_sizes()
        self.torch_dtype = self._resolve_dtype()
        self.eos_token_ids = read_eos_token_ids(self.model, self.hf_config)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.speculative_config.model is not None:
                self._check_draft_model()

    def _check_draft_model(self):
        """A draft must be a family we run, with the target's vocabulary (proposals are token ids)."""
        spec = self.speculative_config
        try:
            path = resolve_model(spec.model, spec.revision, self.download_dir)
            draft = read_model_config(load_hf_config(path, needs_weights=self.load_format == "auto"))
        except ValueError as error:
            raise ValueError(f"speculative_config: draft {error}") from None
        if draft.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) differs "
                             f"from the target's ({self.model_config.vocab_size})")
        self.speculative_config = replace(spec, model=path)   # the draft's engine reads the directory

    def _check_backend(self):
        """The cluster itself (enough GPUs or CPUs for the ranks) is checked when the executor joins
        it, still before any weight is read (executor/ray_processes.py)."""
        backend = self.distributed_executor_backend
        if backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'nanovllm[ray]'")

    def _check_device(self):
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        check_int("tensor_parallel_size", tp, 1)
        check_int("pipeline_parallel_size", pp, 1)
        layers = self.model_config.num_layers
        if pp > layers:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {layers} layers; "
                             "every stage needs at least one")
        sizes = f"tensor_parallel_size={tp}" if pp == 1 else \
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} = {tp * pp} ranks"
        local = self.distributed_executor_backend == "mp"     # Ray's ranks may be on other machines
        if local and self.device == "cuda" and tp * pp > torch.cuda.device_count():
            raise ValueError(f"{sizes} but only {torch.cuda.device_count()} CUDA devices are visible")
        if local and self.device == "cpu" and tp * pp > (os.cpu_count() or 1):
            raise ValueError(f"{sizes} but this machine has only {os.cpu_count()} CPU cores")
        if pp > 1 and self.speculative_config is not None:
            raise ValueError(f"speculative_config is not supported with pipeline_parallel_size={pp}; "
                             "pass one or the other")
        heads, kv_heads = self.model_config.num_heads, self.model_config.num_kv_heads
        if heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={heads}")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={kv_heads}: one must divide the other")

    def _check_sizes(self):
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = min(4096, limit)
        check_int("max_model_len", self.max_model_len, 2, limit)
        window = self.model_config.sliding_window
        if window is not None and window < self.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the model's sliding_window={window}, and "
                f"sliding-window attention is not supported; pass max_model_len <= {window}")
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence decodes one token per step")
        size = self.kvcache_block_size
        if not isinstance(size, int) or size < 16 or size > 256 or size & (size - 1):
            raise ValueError(f"kvcache_block_size must be a power of two in [16, 256], got {size!r}")
        check_int("num_kvcache_blocks", self.num_kvcache_blocks, -1)
        if self.num_kvcache_blocks == 0 or 0 < self.num_kvcache_blocks < self.min_kvcache_blocks:
            raise ValueError(
                f"num_kvcache_blocks must be -1 (size from memory) or at least {self.min_kvcache_blocks} "
                f"(one sequence of max_model_len={self.max_model_len}), got {self.num_kvcache_blocks}")
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}")
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ValueError("speculative_config: a runner='pooling' engine only prefills; leave it out")
        if self.runner == "pooling" and self.pipeline_parallel_size > 1:
            raise ValueError("runner='pooling' runs on one pipeline stage (pipeline_parallel_size=1); "
                             "tensor_parallel_size spreads it over several devices")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "disable_custom_all_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_kv_offload()

    def _check_kv_offload(self):
        check_number("kv_offload_gib", self.kv_offload_gib, 0.0)
        if not self.kv_offload_gib:
            return
        if not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib keeps evicted prefix-cache blocks: it needs enable_prefix_caching=True")
        available = available_host_memory_bytes()
        if self.kv_offload_gib * 2**30 > available:
            raise ValueError(f"kv_offload_gib={self.kv_offload_gib} does not fit in host memory: "
                             f"{available / 2**30:.1f} GiB available")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def min_kvcache_blocks(self) -> int:
        return -(-self.max_model_len // self.kvcache_block_size)

    def draft_config(self, max_num_seqs: int) -> "Config":
        """The draft model's engine config (speculative_config["model"]): the target's device, dtype
        and lengths, a fixed pool for max_num_seqs sequences of max_model_len, no prefix caching."""
        return Config(self.speculative_config.model, device=self.device,
                      dtype=str(self.torch_dtype).removeprefix("torch."), max_model_len=self.max_model_len,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                      kvcache_block_size=self.kvcache_block_size,
                      num_kvcache_blocks=max_num_seqs * self.min_kvcache_blocks, enable_prefix_caching=False,
                      enforce_eager=self.enforce_eager, load_format=self.load_format)

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            if self.device == "cpu":
                return torch.float32
            return self.model_config.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]


def available_host_memory_bytes() -> int:
    """Memory the system can give without swapping (MemAvailable), or else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_hf_config(model: str, needs_weights: bool = True) -> PretrainedConfig:
    """The checkpoint's config.json as transformers reads it; `read_model_config` says if we can run it."""
    if not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is not a local directory")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model: {model!r} has no config.json")
    if needs_weights and not glob.glob(os.path.join(model, "*.safetensors")):
        raise ValueError(f"model: {model!r} has no *.safetensors weight files")
    return AutoConfig.from_pretrained(model)


def read_eos_token_ids(model: str, hf_config: PretrainedConfig) -> tuple[int, ...]:
    """EOS ids from config.json and, where present, generation_config.json (chat models list several)."""
    ids = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig
        sources.append(GenerationConfig.from_pretrained(model).eos_token_id)
    except OSError:
        pass
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return tuple(sorted(ids))
