"""`telemetry.tokenizer: <model dir>`: token ids computed in the gateway the way vLLM computes them.

Kept free of the gateway's other dependencies (it needs only the optional `tokenizers` and `jinja2`), so the
real-vLLM suite can run it next to the engine's own environment and compare token for token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _special(v: Any) -> str:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with its `content`."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


def _raise(message: str) -> None:
    raise ValueError(message)


class LocalTokenizer:
    """tokenizer.json (HF `tokenizers`) + the model's chat template (jinja2), rendered the way vLLM does through
    transformers' apply_chat_template: `chat_template.jinja` when present, else tokenizer_config.json's
    `chat_template` (the "default" one of a named list); the template sees `bos_token`/`eos_token`/...,
    `raise_exception`, `strftime_now`, `tools`, `add_generation_prompt=True` and the request's
    `chat_template_kwargs`; the rendered text is encoded without adding special tokens (the template has
    them), a completion prompt with them. Needs the optional `tokenizers` and `jinja2` packages
    (`pip install '.[tokenizer]'`); checked token for token against a real vLLM engine in tests/vllm."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # optional dependency

        p = Path(path)
        self._tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
        d = p if p.is_dir() else p.parent
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self._specials = {k: _special(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        tmpl: Any = None
        if (d / "chat_template.jinja").exists():
            tmpl = (d / "chat_template.jinja").read_text()
        else:
            tmpl = cfg.get("chat_template")
            if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
                tmpl = named.get("default") or next(iter(named.values()), None)
        self._template = None
        if isinstance(tmpl, str) and tmpl:
            import datetime

            import jinja2.ext
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=[jinja2.ext.loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
                x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
            self._template = env.from_string(tmpl)

    def encode_body(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            if self._template is None:
                raise ValueError("no chat template")
            extra = body.get("chat_template_kwargs")
            text = self._template.render(**self._specials, messages=body["messages"], tools=body.get("tools"),
                                         add_generation_prompt=True, **(extra if isinstance(extra, dict) else {}))
            return self._tok.encode(text, add_special_tokens=False).ids
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            if prompt and isinstance(prompt[0], int):
                return list(prompt)
            prompt = "".join(map(str, prompt))
        return self._tok.encode(prompt, add_special_tokens=True).ids
