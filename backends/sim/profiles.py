"""Engine profiles: the cost model's constants and the engine's capacity, per hardware class.

Step time = a + b * prefill_tokens + c * decode_seqs + d * decode_context_tokens, where
  a: fixed per-step cost (reading the weights once per forward pass, scheduling, sampling),
  b: per prefill token (compute-bound matmuls),
  c: per decoding sequence (sampling and per-sequence kernels),
  d: per token of context held by decoding sequences (attention reads the KV cache: memory-bound; for a
     Llama-3-8B in bf16 that is 2 * 32 layers * 8 KV heads * 128 dims * 2 bytes = 128 KiB per token).
Numbers are public-benchmark ballparks for Llama-3-8B-class models, not measurements of a specific box.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EngineProfile:
    name: str
    step_overhead_s: float  # a
    prefill_s_per_token: float  # b
    decode_s_per_seq: float  # c
    attn_s_per_ctx_token: float  # d
    max_num_batched_tokens: int  # chunked-prefill token budget per step
    max_num_seqs: int  # max running sequences
    num_gpu_blocks: int  # KV capacity in blocks
    block_size: int = 16
    max_model_len: int = 8192
    stream_interval_s: float = 0.1  # after the first token, stream chunks at most this often
    description: str = ""

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def step_time(self, prefill_tokens: int, decode_seqs: int, decode_ctx_tokens: int) -> float:
        """The cost model; pure so that tests and the predictor can call it."""
        return (self.step_overhead_s + self.prefill_s_per_token * prefill_tokens
                + self.decode_s_per_seq * decode_seqs + self.attn_s_per_ctx_token * decode_ctx_tokens)

    def with_overrides(self, **kw: object) -> "EngineProfile":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})  # type: ignore[arg-type]


PROFILES: dict[str, EngineProfile] = {
    # H200 (141 GB HBM3e, 4.8 TB/s): 16 GB of bf16 weights read per step ~3.3 ms + launch/sampling ~3.7 ms;
    # prefill ~16k tok/s; decode step at batch 32 and 2k context ~7 + 4.8 + 1.7 = 13.5 ms;
    # KV: (141 * 0.9 - 16) GB / 128 KiB ~ 850k tokens -> 50k blocks of 16.
    "h200-8b": EngineProfile(
        name="h200-8b", step_overhead_s=0.007, prefill_s_per_token=1 / 16000, decode_s_per_seq=0.00015,
        attn_s_per_ctx_token=2.7e-8, max_num_batched_tokens=8192, max_num_seqs=256, num_gpu_blocks=50_000,
        max_model_len=32768, description="Llama-3-8B-class on one H200"),
    # L40S (48 GB GDDR6, 864 GB/s): weights read ~18.5 ms per step; prefill ~6k tok/s; d = 128 KiB / 864 GB/s;
    # KV: (48 * 0.9 - 16) GB / 128 KiB ~ 210k tokens -> 13k blocks of 16.
    "l40s-8b": EngineProfile(
        name="l40s-8b", step_overhead_s=0.020, prefill_s_per_token=1 / 6000, decode_s_per_seq=0.0003,
        attn_s_per_ctx_token=1.5e-7, max_num_batched_tokens=4096, max_num_seqs=128, num_gpu_blocks=13_000,
        max_model_len=16384, description="Llama-3-8B-class on one L40S"),
    # `gateway sim`'s default: vLLM 0.32's own scheduler defaults for an OpenAI server on a GPU under 70 GiB (and
    # on CPU): max_num_batched_tokens 2048, max_num_seqs 256 (vllm/engine/arg_utils.py
    # `EngineArgs.get_batch_defaults`, UsageContext.OPENAI_API_SERVER; >= 70 GiB non-A100 GPUs get 8192 and
    # 1024, >= 160 GiB 16384); the L40S cost model and KV capacity. An operator's own settings vary: profiles
    # above are tuned fleets, not defaults.
    "vllm-default": EngineProfile(
        name="vllm-default", step_overhead_s=0.020, prefill_s_per_token=1 / 6000, decode_s_per_seq=0.0003,
        attn_s_per_ctx_token=1.5e-7, max_num_batched_tokens=2048, max_num_seqs=256, num_gpu_blocks=13_000,
        max_model_len=16384, description="vLLM's default scheduler budget (2048 tokens/step), L40S-class GPU"),
    # For tests: fast steps, a small KV cache (1024 tokens) so evictions and queueing are easy to provoke.
    "tiny": EngineProfile(
        name="tiny", step_overhead_s=0.002, prefill_s_per_token=0.00002, decode_s_per_seq=0.0001,
        attn_s_per_ctx_token=0.0, max_num_batched_tokens=512, max_num_seqs=8, num_gpu_blocks=64,
        max_model_len=1024, stream_interval_s=0.02, description="toy engine for tests"),
}


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown sim profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
