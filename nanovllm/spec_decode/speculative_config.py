"""The `speculative_config` engine argument (vLLM's spelling), checked once."""
from dataclasses import dataclass

NGRAM_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str                    # "ngram": prompt lookup on the host
    num_speculative_tokens: int    # k: proposals verified per step
    prompt_lookup_max: int = 4     # longest suffix matched
    prompt_lookup_min: int = 1     # shortest suffix matched

    @classmethod
    def from_dict(cls, config) -> "SpeculativeConfig":
        """A SpeculativeConfig from the engine argument, or a ValueError naming speculative_config."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        method = config.get("method")
        if method != "ngram":
            raise ValueError(f"speculative_config: unknown method {method!r}; supported: 'ngram'")
        unknown = sorted(set(config) - NGRAM_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(NGRAM_KEYS)}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        values = {key: config.get(key, default) for key, default in
                  (("num_speculative_tokens", None), ("prompt_lookup_max", 4), ("prompt_lookup_min", 1))}
        for key, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {key} must be an int >= 1, got {value!r}")
        if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
            raise ValueError(f"speculative_config: prompt_lookup_min ({values['prompt_lookup_min']}) must be <= "
                             f"prompt_lookup_max ({values['prompt_lookup_max']})")
        return cls(method, **values)
