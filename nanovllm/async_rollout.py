"""Rollout control on AsyncLLM (docs/rollout.md): the engine's rollout methods as coroutines, each
carried to the engine loop as an EngineCall and run there between steps (on the engine thread, or
in the engine process: tensors pickle through the pipe), plus pause_generation / resume_generation.
Mixed into AsyncLLM.

    await llm.pause_generation()          # no step runs; live requests keep their state
    await llm.update_weights(policy.state_dict())
    await llm.resume_generation()         # they continue on the new weights
"""
from collections.abc import Iterable

from nanovllm.engine_loop import EngineCall


class AsyncRollout:
    async def _engine_call(self, method: str, *args, **kwargs):
        """Run `method` in the engine loop; its result, or its error raised here."""
        return await self._ask_engine(self._call_replies, lambda token: EngineCall(method, args, kwargs, token))

    async def update_weights(self, weights: Iterable, weight_version: int | None = None) -> int:
        """LLMEngine.update_weights: (checkpoint name, tensor) pairs or a dict, loaded in place;
        returns the new weight_version. The tensors are taken (detached) when this is called."""
        pairs = list(weights.items() if isinstance(weights, dict) else weights)
        pairs = [(name, tensor.detach()) if hasattr(tensor, "detach") else (name, tensor) for name, tensor in pairs]
        return await self._engine_call("update_weights", pairs, weight_version)

    async def update_weights_from_disk(self, path: str, weight_version: int | None = None) -> int:
        return await self._engine_call("update_weights_from_disk", path, weight_version)

    async def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                       world_size: int, backend: str = "nccl") -> None:
        return await self._engine_call("init_weight_update_group", master_address, master_port, rank_offset,
                                       world_size, backend)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                              weight_version: int | None = None) -> int:
        dtypes = [str(d).removeprefix("torch.") for d in dtypes]     # torch dtypes pickle, names are lighter
        shapes = [tuple(int(n) for n in shape) for shape in shapes]
        return await self._engine_call("update_weights_from_distributed", list(names), dtypes, shapes,
                                       weight_version)

    async def weight_version(self) -> int:
        return await self._engine_call("weight_version")

    async def reset_prefix_cache(self) -> bool:
        return await self._engine_call("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        """Free the KV pool, weights to host memory (level 1) or dropped (2); the engine must be
        idle (no live request), else a RuntimeError."""
        return await self._engine_call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return await self._engine_call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._engine_call("is_sleeping")

    async def pause_generation(self) -> None:
        """From the next loop iteration no step runs: live requests keep their state (and KV blocks)
        and continue after resume_generation; new requests are accepted and wait."""
        return await self._engine_call("pause_generation")

    async def resume_generation(self) -> None:
        return await self._engine_call("resume_generation")

    async def is_paused(self) -> bool:
        return await self._engine_call("is_paused")
