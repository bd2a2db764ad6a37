"""Benchmark: the response cache's semantic tier on a deterministic labelled set, and the latency it adds.

    python bench/cache.py [--embedder wordllama|lexical] [--similarity 0.9] [--seed 7] [--quality-only]

The set: templates x paraphrase rules x entity / number / negation swaps (generated here, >= 2,000 pairs).
A "paraphrase" pair keeps the intent (filler, politeness, word order of a clause, case, punctuation, a
function-word rewrite, and content-word synonyms, which the lexical embedder is not expected to catch); a "near-miss" pair changes one entity,
one number, adds a negation, or shares only the last message of a multi-turn conversation. Each pair runs in a
fresh store: serve A (stored), look B up. Hit rate on paraphrases and false-hit rate on near-misses are printed
at the threshold, then the stage's added latency (exact hit, semantic hit, miss) with 1,000 entries in the
partition, on this one process (one core); then a mixed workload on one shared store (hit rate, false hits
against the intent each entry was made for, GPU tokens saved).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.cache.config import CacheConfig, CacheLocation  # noqa: E402
from gateway.cache.embed import LexicalEmbedder, WordLlamaEmbedder, load_wordllama  # noqa: E402
from gateway.cache.spec import CacheSpec  # noqa: E402
from gateway.cache.stage import CacheStage  # noqa: E402
from gateway.cache.store import MemoryStore  # noqa: E402
from gateway.pipeline import RequestContext  # noqa: E402
from gateway.types import Decision, Principal, Usage  # noqa: E402

TEMPLATES = [
    "How do I reset the password for my {e} account?",
    "What is the refund policy for order {n} from {e}?",
    "Can I upgrade my {e} plan to {n} seats?",
    "Where can I download the invoice for order {n}?",
    "How long does shipping to {e} take?",
    "Is the {e} integration available on the free plan?",
    "What are the opening hours of the {e} office?",
    "How do I export {n} rows from the {e} dashboard?",
    "Why was my card charged {n} euros by {e}?",
    "How do I add a second admin to the {e} workspace?",
    "What does error code {n} mean in {e}?",
    "Can I transfer my {e} licence to a new laptop?",
    "How do I cancel my {e} subscription before day {n}?",
    "Which browsers does the {e} web app support?",
    "How do I enable two factor login for {e}?",
    "What is the storage limit of the {e} basic plan?",
    "Can I change the delivery address of order {n}?",
    "How do I connect {e} to my calendar?",
    "Does {e} support single sign on?",
    "How many API calls per minute does the {e} plan allow for {n} users?",
]
ENTITIES = ["Orion", "Atlas", "Nimbus", "Vega", "Helix", "Quasar", "Lumen", "Zephyr"]
NUMBERS = ["12", "40", "250", "1234", "7", "99"]
PREFIXES = ["", "Please, ", "Hi! ", "Quick question: ", "Hello, could you tell me: ", "Hey, I was wondering, "]
SUFFIXES = ["", " Thanks!", " Thank you.", " Please help.", "?"]


def paraphrases(text: str, rnd: random.Random) -> list[tuple[str, str]]:
    base = text.rstrip("?")
    out = [
        ("prefix", rnd.choice(PREFIXES[1:]) + text[0].lower() + text[1:]),
        ("suffix", text + rnd.choice(SUFFIXES[1:])),
        ("case_punct", base.lower() + " ??"),
        ("prefix+suffix", rnd.choice(PREFIXES[1:]) + base.lower() + rnd.choice(SUFFIXES[1:])),
        ("could_you", "Could you explain " + base[0].lower() + base[1:] + "?"),
        ("synonym", text.replace("How do I", "What is the way to").replace("Can I", "Am I able to")
         .replace("What is", "Tell me").replace("download", "get")),
    ]
    words = text
    for a, b in CONTENT_SYNONYMS:
        words = words.replace(a, b)
    if words != text:
        out.append(("synonym_words", words))
    return out


# content words swapped for synonyms (what a lexical embedder cannot match; no numbers, names or negations)
CONTENT_SYNONYMS = [("reset", "change"), ("refund policy", "returns policy"), ("upgrade", "bump"),
                    ("invoice", "bill"), ("shipping", "delivery"), ("integration", "connector"),
                    ("opening hours", "business hours"), ("export", "extract"), ("charged", "billed"),
                    ("second admin", "another administrator"), ("error code", "fault code"),
                    ("transfer", "move"), ("laptop", "notebook"), ("cancel", "end"), ("browsers", "web clients"),
                    ("enable", "switch on"), ("storage limit", "storage cap"), ("delivery address", "shipping address"),
                    ("connect", "link"), ("support single", "offer single"), ("API calls", "API requests")]


NEG = [("How do I", "How do I not"), ("Can I", "Can't I"), ("Is the", "Isn't the"), ("Does", "Doesn't"),
       ("What is", "What is not"), ("Why was", "Why wasn't"), ("Where can I", "Where can't I"),
       ("Which", "Which do not")]


def near_misses(tpl: str, e: str, n: str, rnd: random.Random) -> list[tuple[str, str]]:
    text = tpl.format(e=e, n=n)
    out = []
    if "{e}" in tpl:
        out.append(("entity", tpl.format(e=rnd.choice([x for x in ENTITIES if x != e]), n=n)))
    if "{n}" in tpl:
        out.append(("number", tpl.format(e=e, n=rnd.choice([x for x in NUMBERS if x != n]))))
    for a, b in NEG:
        if text.startswith(a):
            out.append(("negation", b + text[len(a):]))
            break
    return out


def labelled_pairs(seed: int) -> list[tuple[list, list, str, str]]:
    rnd = random.Random(seed)
    pairs: list[tuple[list, list, str, str]] = []
    seen: set[str] = set()
    for ti, tpl in enumerate(TEMPLATES):
        for e in ENTITIES if "{e}" in tpl else ENTITIES[:1]:
            for n in NUMBERS[:4] if "{n}" in tpl else NUMBERS[:1]:
                text = tpl.format(e=e, n=n)
                if text in seen:
                    continue
                seen.add(text)
                a = [{"role": "user", "content": text}]
                for rule, p in paraphrases(text, rnd):
                    pairs.append((a, [{"role": "user", "content": p}], "paraphrase", rule))
                for rule, m in near_misses(tpl, e, n, rnd):
                    pairs.append((a, [{"role": "user", "content": m}], "near_miss", rule))
                other = TEMPLATES[(ti + 1) % len(TEMPLATES)].format(e=e, n=n)  # another first question
                conv_a = [{"role": "user", "content": text}, {"role": "assistant", "content": "Sure."},
                          {"role": "user", "content": "Yes, please do that now."}]
                conv_b = [{"role": "user", "content": other}, {"role": "assistant", "content": "Sure."},
                          {"role": "user", "content": "Yes, please do that now."}]
                pairs.append((conv_a, conv_b, "near_miss", "multi_turn_last_only"))
    return pairs


EMBEDDERS = {"wordllama": WordLlamaEmbedder, "lexical": LexicalEmbedder}
EMBEDDER = "wordllama"


def stage_for(similarity: float) -> tuple[CacheStage, MemoryStore]:
    cc = CacheConfig(location=CacheLocation(country="DE"), default_similarity=similarity, embedder=EMBEDDER)
    store = MemoryStore(100_000, cc.location)
    return CacheStage(lambda: SimpleNamespace(raw=SimpleNamespace(cache=cc)), store, EMBEDDERS[EMBEDDER](), None), store


_i = 0


def ctx_for(messages: list, mode: str, similarity: float) -> RequestContext:
    global _i
    _i += 1
    c = RequestContext(request_id=f"r{_i}", endpoint="chat", headers={}, body={"model": "m", "messages": messages})
    c.model = "m"
    c.principal = Principal(id="k", kind="static_key", tenant="t")
    c.decision = Decision(cache=CacheSpec(mode=mode, similarity=similarity if mode == "semantic" else None))
    return c


ANSWER = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                    "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 20, "completion_tokens": 40, "total_tokens": 60}}


async def store_one(stage: CacheStage, messages: list, mode: str, sim: float) -> None:
    c = ctx_for(messages, mode, sim)
    await stage.run(c)
    if c.cache is not None:
        c.cache.capture.json(ANSWER)
        c.usage, c.status = Usage(20, 40), 200
        await stage.finish(c)


async def quality(sim: float, seed: int) -> None:
    pairs = labelled_pairs(seed)
    by: dict[tuple[str, str], list[int]] = {}
    for a, b, label, rule in pairs:
        stage, _ = stage_for(sim)
        await store_one(stage, a, "semantic", sim)
        c = ctx_for(b, "semantic", sim)
        await stage.run(c)
        by.setdefault((label, rule), []).append(1 if c.answer is not None else 0)
    para = [x for (lab, _), v in by.items() if lab == "paraphrase" for x in v]
    near = [x for (lab, _), v in by.items() if lab == "near_miss" for x in v]
    print(f"labelled pairs: {len(pairs)} ({len(para)} paraphrase, {len(near)} near-miss), threshold {sim}, "
          f"embedder {EMBEDDER}")
    print(f"{'label':<11} {'rule':<22} {'pairs':>6} {'hit rate':>9}")
    for (lab, rule), v in sorted(by.items()):
        print(f"{lab:<11} {rule:<22} {len(v):>6} {sum(v) / len(v):>9.3f}")
    print(f"paraphrase hit rate: {sum(para) / len(para):.3f}   near-miss false-hit rate: "
          f"{sum(near) / len(near):.4f} ({sum(near)}/{len(near)})")


async def latency(sim: float) -> None:
    stage, store = stage_for(sim)
    rnd = random.Random(3)
    texts = [tpl.format(e=f"{rnd.choice(ENTITIES)}{i}", n=str(i)) for i, tpl in
             ((i, TEMPLATES[i % len(TEMPLATES)]) for i in range(1000))]
    for t in texts:
        await store_one(stage, [{"role": "user", "content": t}], "semantic", sim)

    async def timed(messages: list, mode: str, n: int = 400) -> list[float]:
        out = []
        for _ in range(n):
            c = ctx_for(messages, mode, sim)
            t0 = time.perf_counter()
            await stage.run(c)
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    rows = [("exact hit", await timed([{"role": "user", "content": texts[5]}], "exact")),
            ("exact miss", await timed([{"role": "user", "content": "never seen " + texts[5]}], "exact")),
            ("semantic hit", await timed([{"role": "user", "content": "Please, " + texts[5].lower()}], "semantic")),
            ("semantic miss", await timed([{"role": "user", "content": "Totally new question about Kepler"}],
                                          "semantic"))]
    print(f"\nadded latency of the cache stage, {len(store)} entries in the partition (one process):")
    print(f"{'case':<14} {'p50 us':>8} {'p99 us':>8}")
    for name, v in rows:
        v.sort()
        print(f"{name:<14} {statistics.median(v):>8.1f} {v[int(len(v) * 0.99) - 1]:>8.1f}")


async def mixed(sim: float, seed: int, n: int = 3000) -> None:
    """One shared store, a Zipf-ish stream of FAQ traffic: exact repeats, paraphrases and near misses of the
    same base questions. A hit is false when the entry was created for a different intent (another base, or a
    near-miss variant of it). Tokens: prompt ~ chars/4, completion 64 per answer (a stand-in for the engine's)."""
    rnd = random.Random(seed)
    seen: dict[str, tuple] = {}  # one base per distinct text (a template without {e} is one base per number)
    for ti, tpl in enumerate(TEMPLATES):
        for e in ENTITIES[:6]:
            for nn in (NUMBERS[:3] if "{n}" in tpl else NUMBERS[:1]):
                seen.setdefault(tpl.format(e=e, n=nn), (ti, tpl, e, nn))
    bases = list(seen.values())
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(bases))]
    base_of = {tpl.format(e=e, n=nn): (ti, e, nn) for ti, tpl, e, nn in bases}
    stage, store = stage_for(sim)
    intent_of: dict[str, tuple] = {}
    hits = false_hits = 0
    total_tokens = saved_tokens = 0
    for _ in range(n):
        ti, tpl, e, nn = rnd.choices(bases, weights)[0]
        text = tpl.format(e=e, n=nn)
        kind = rnd.random()
        if kind < 0.4:
            q, intent = text, (ti, e, nn)
        elif kind < 0.8:
            q, intent = rnd.choice(paraphrases(text, rnd))[1], (ti, e, nn)
        else:
            nm = near_misses(tpl, e, nn, rnd)
            rule, q = rnd.choice(nm)
            # a swapped entity or number can land on another base question (then that is its intent); else
            # (a negation, a value outside the bases) it is its own intent: only an identical copy may share it
            intent = base_of.get(q, ("own", q))
        tokens = len(q) // 4 + 64
        total_tokens += tokens
        c = ctx_for([{"role": "user", "content": q}], "semantic", sim)
        await stage.run(c)
        if c.answer is not None:
            hits += 1
            saved_tokens += tokens
            if intent_of.get(c.evidence["cache"]["entry"]) != intent:
                false_hits += 1
        else:
            c.cache.capture.json(ANSWER)
            c.usage, c.status = Usage(len(q) // 4, 64), 200
            await stage.finish(c)
            intent_of[c.evidence["cache"]["key"]] = intent
    print(f"\nmixed workload: {n} requests over {len(bases)} base questions (40% repeats, 40% paraphrases, "
          f"20% near misses), one store ({len(store)} entries at the end)")
    print(f"hit rate {hits / n:.3f}   false hits {false_hits} ({false_hits / max(1, hits):.4f} of hits)   "
          f"GPU tokens saved {saved_tokens}/{total_tokens} = {saved_tokens / total_tokens:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--embedder", choices=sorted(EMBEDDERS), default=CacheConfig().embedder)
    ap.add_argument("--similarity", type=float, nargs="+", default=[CacheConfig().default_similarity],
                    help="one or more thresholds (the quality table per threshold; latency and mixed at the first)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quality-only", action="store_true")
    a = ap.parse_args()
    global EMBEDDER
    EMBEDDER = a.embedder
    if EMBEDDER == "wordllama":
        t0 = time.perf_counter()
        load_wordllama()
        print(f"wordllama model loaded in {time.perf_counter() - t0:.2f} s (offline, from the package's files)")
    for sim in a.similarity:
        asyncio.run(quality(sim, a.seed))
    if not a.quality_only:
        asyncio.run(latency(a.similarity[0]))
        asyncio.run(mixed(a.similarity[0], a.seed))


if __name__ == "__main__":
    main()
