"""vLLM's LoRA surface for one simulated engine: adapters given at start (`--lora-modules`) and, with runtime
updating allowed (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), `POST /v1/load_lora_adapter {"lora_name",
"lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`.

Behaviour and messages follow vLLM 0.32 (vllm/entrypoints/openai/models/serving.py, entrypoints/serve/lora):
a load needs both fields (400), may not use a base model's name (400), may not load a name already loaded
unless `load_inplace` (400); it answers 200 with a plain-text success line. An unload needs the name (400) and
404s for a name not loaded. Loaded adapters are listed by /v1/models (root: the path, parent: the base model).
A request naming an adapter that is not loaded gets vLLM's 404 "The model `x` does not exist. Valid aliases: <base>.". vLLM itself
holds any number of loaded adapters; `max_cpu_loras` (default `max_loras`) of them keep their weights in memory
(an LRU cache: a load puts the adapter in it, and a step that runs an adapter outside it reads it again first,
taking `load_s` longer: static placement of more adapters than the cache pays loads inside the engine);
`max_loras` bounds how many distinct adapters one batch runs, so requests for a further adapter wait (the
scheduler, `waiting_lora_adapters` in `vllm:lora_requests_info`). A load takes `load_s` (reading and preparing
the weights); a restart loses every adapter loaded at run time (the static ones come back).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoraConfig:
    """--enable-lora and what goes with it."""

    max_loras: int = 1  # vLLM's default
    load_s: float = 0.5  # modelled time to read and prepare one adapter's weights
    max_cpu_loras: int | None = None  # adapters whose weights stay in memory (vLLM's default: max_loras)

    @property
    def cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
    runtime_updating: bool = True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING


class LoraError(Exception):
    """vLLM's ErrorResponse for the LoRA routes: 400 InvalidUserInput, 404 NotFoundError."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "NotFoundError" if self.status == 404 else
                          "InvalidUserInput", "param": None, "code": self.status}}


class LoraState:
    def __init__(self, base_model: str, static: list[str], cfg: LoraConfig | None) -> None:
        self.base_model = base_model
        self._static0 = list(static)
        self.static = list(static)  # vLLM loads these at start; they can be unloaded like any other
        self.cfg = cfg
        self.dynamic: dict[str, str] = {}  # name -> path, loaded at run time
        self.loads = 0  # sim only: completed loads (what the benchmark counts)
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def runtime(self) -> bool:
        return self.cfg is not None and self.cfg.runtime_updating

    def has(self, name: str) -> bool:
        return name in self.dynamic or name in self.static

    def names(self) -> list[tuple[str, str]]:
        """(name, root) of every adapter served: static ones (root = name, as the sim has no path) then loaded."""
        return [(n, n) for n in self.static] + [(n, p) for n, p in self.dynamic.items() if n not in self.static]

    def clear(self) -> None:
        """A restarted process: what was loaded at run time is gone."""
        self.dynamic.clear()
        self.static = list(self._static0)

    async def load(self, body: dict[str, Any]) -> str:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise LoraError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_model:
            raise LoraError(400, f"The lora adapter '{name}' conflicts with a served base model.")
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if not body.get("load_inplace") and self.has(name):
                raise LoraError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                     "adapter in place, set 'load_inplace' to True.")
            await asyncio.sleep(self.cfg.load_s if self.cfg is not None else 0.0)
            self.dynamic[name] = path
            self.loads += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict[str, Any]) -> str:
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            raise LoraError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        if not self.has(name):
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.")
        self.dynamic.pop(name, None)
        if name in self.static:
            self.static.remove(name)
        return f"Success: LoRA adapter '{name}' removed successfully."
