"""The `speculative_config` engine argument (vLLM's spelling), checked once."""
from dataclasses import dataclass

NGRAM_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
DRAFT_KEYS = {"method", "model", "num_speculative_tokens", "revision"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str                    # "ngram": prompt lookup on the host; "draft_model": a smaller model
    num_speculative_tokens: int    # k: proposals verified per step
    prompt_lookup_max: int = 4     # ngram: longest suffix matched
    prompt_lookup_min: int = 1     # ngram: shortest suffix matched
    model: str | None = None       # draft_model: its checkpoint directory or Hugging Face repo id (same vocabulary)
    revision: str | None = None    # draft_model: the repo id's branch, tag or commit

    @classmethod
    def from_dict(cls, config) -> "SpeculativeConfig":
        """A SpeculativeConfig from the engine argument, or a ValueError naming speculative_config.
        (The draft model itself is checked against the target by Config.)"""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        method = config.get("method", "draft_model" if "model" in config else None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: unknown method {method!r}; supported: 'ngram', or a draft "
                             "'model' (method 'draft_model')")
        known = NGRAM_KEYS if method == "ngram" else DRAFT_KEYS
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} for method {method!r}; "
                             f"known: {sorted(known)}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        if method == "draft_model":
            if not isinstance(config.get("model"), str):
                raise ValueError("speculative_config: model must be a checkpoint directory or repo id, "
                                 f"got {config.get('model')!r}")
            if not isinstance(config.get("revision", ""), str):
                raise ValueError(f"speculative_config: revision must be a str, got {config['revision']!r}")
            values = {"num_speculative_tokens": config["num_speculative_tokens"]}
        else:
            values = {key: config.get(key, default) for key, default in
                      (("num_speculative_tokens", None), ("prompt_lookup_max", 4), ("prompt_lookup_min", 1))}
        for key, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {key} must be an int >= 1, got {value!r}")
        if method == "ngram" and values["prompt_lookup_min"] > values["prompt_lookup_max"]:
            raise ValueError(f"speculative_config: prompt_lookup_min ({values['prompt_lookup_min']}) must be <= "
                             f"prompt_lookup_max ({values['prompt_lookup_max']})")
        return cls(method, **values, model=config.get("model"), revision=config.get("revision"))
