"""Generate a tiny LoRA adapter in PEFT's layout for the tiny model of backends/vllm/model.py, with no download.

Why: the real-engine test of issue 38 loads an adapter into vLLM at run time; none can be fetched here, so one is
made: `adapter_config.json` (peft_type LORA, rank, alpha, target modules q_proj and v_proj) and
`adapter_model.safetensors` with `base_model.model.model.layers.<i>.self_attn.<proj>.lora_A.weight` (rank x in)
and `...lora_B.weight` (out x rank) for every layer, shapes read from the model's config.json. Weights are small
random numbers (deterministic for a seed), so the adapter changes the model's output a little.

Run with the vLLM venv (needs torch, safetensors):
    .venv-vllm/bin/python -m backends.vllm.lora MODEL_DIR OUTDIR [--rank 8] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = ("q_proj", "v_proj")


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a Llama-style config."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim)}


def adapter_config(model_dir: str, rank: int) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_dir, "r": rank,
            "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "target_modules": list(TARGETS), "inference_mode": True}


def generate(model_dir: Path, outdir: Path, rank: int = 8, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = projection_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for proj in TARGETS:
            fan_in, fan_out = shapes[proj]
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.02).to(torch.float32)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.02).to(torch.float32)
    outdir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(outdir / "adapter_model.safetensors"))
    (outdir / "adapter_config.json").write_text(json.dumps(adapter_config(str(model_dir), rank), indent=2) + "\n")
    return outdir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 0 < a.rank <= 256:
        ap.error("--rank must be 1-256")
    print(generate(a.model_dir, a.outdir, a.rank, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
