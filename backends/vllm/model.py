"""Generate a tiny, randomly initialised Llama-style model that vLLM can serve, with no download.

Why: no model hub is reachable here, yet the gateway's real-engine tests need an engine whose prefix cache,
KV events and tokenizer behave like production. Output is deterministic for a given seed: a byte-level BPE
tokenizer (trained on synthetic text), a ChatML chat template, and a LlamaForCausalLM with random weights.

Run with the vLLM venv (needs torch, transformers, tokenizers):
    .venv-vllm/bin/python -m backends.vllm.model OUTDIR [--seed 0] [--vocab-size 2048]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SERVED_NAME = "tiny-llama"

# ChatML: what Qwen-style models use; vLLM's chat endpoint renders it through the tokenizer's chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

MODEL_CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,  # CPU attention supports head_dim in {32, 64, 80, 96, 112, 128, ...}
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}

_SYLLABLES = ["ka", "lo", "mi", "ne", "ra", "su", "ti", "vo", "ze", "pa", "qui", "bri", "dan", "fel", "gor",
              "hum", "jix", "mor", "nat", "olp", "ret", "sam", "tun", "wex", "yal"]
_WORDS = ["the", "cache", "block", "token", "engine", "gateway", "request", "prefix", "policy", "budget",
          "route", "model", "prompt", "stream", "event", "replay", "metric", "latency", "tenant", "key"]


def synthetic_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic training text: English-ish words, invented words, numbers and code-like lines."""
    rng = random.Random(seed)
    vocab = _WORDS + ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    lines = []
    for i in range(n_lines):
        kind = i % 4
        words = [rng.choice(vocab) for _ in range(rng.randint(4, 18))]
        if kind == 0:
            lines.append(" ".join(words).capitalize() + ".")
        elif kind == 1:
            lines.append(f"def {words[0]}_{words[1]}(x, y={rng.randint(0, 999)}):\n    return x + {words[2]!r}")
        elif kind == 2:
            lines.append(json.dumps({w: rng.randint(0, 10**6) for w in words[:4]}))
        else:
            lines.append(", ".join(words) + f"? {rng.random():.4f} ({rng.choice(_SYLLABLES).upper()})")
    return lines


def build_tokenizer(outdir: Path, seed: int, vocab_size: int) -> int:
    """Train a byte-level BPE on the synthetic corpus and save tokenizer.json + configs; returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MODEL_CONFIG["max_position_embeddings"]
    fast.save_pretrained(str(outdir))
    # Older transformers write the template only to chat_template.jinja; keep it in tokenizer_config.json too.
    cfg_path = outdir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return tok.get_vocab_size()


def build_model(outdir: Path, seed: int, vocab_size: int, eos_id: int, pad_id: int) -> int:
    """Save a randomly initialised LlamaForCausalLM (bf16 safetensors); returns the parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
                         torch_dtype="bfloat16", **MODEL_CONFIG)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(outdir), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(str(outdir))
    return sum(p.numel() for p in model.parameters())


def generate(outdir: Path, seed: int = 0, vocab_size: int = 2048) -> dict:
    """Write tokenizer + model to outdir; returns a summary dict (also written as tiny_model.json)."""
    outdir.mkdir(parents=True, exist_ok=True)
    actual_vocab = build_tokenizer(outdir, seed, vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(outdir))
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    params = build_model(outdir, seed, actual_vocab, eos_id, pad_id)
    summary = {"served_name": SERVED_NAME, "seed": seed, "vocab_size": actual_vocab, "parameters": params,
               **MODEL_CONFIG}
    (outdir / "tiny_model.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.vllm.model", description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=2048)
    args = ap.parse_args(argv)
    print(json.dumps(generate(args.outdir, args.seed, args.vocab_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
