"""Config section `routing:` (owned by routing and admission)."""
from __future__ import annotations

from typing import Any

import msgspec

from gateway.routing import registry


class PluginSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One entry of a `routing.strategy` list: a registered filter, scorer or picker (docs/routing.md). Instead
    of a list, `routing.strategy` may name a preset: predicted_ttft (default), least_loaded, round_robin,
    prefix_hash, target_fit."""

    type: str  # capacity | predicted_ttft | load | prefix_hash | target_fit | min_score | round_robin
    weight: float | None = None  # scorers only: total = sum(weight x score), >= 0; default 1
    params: dict[str, Any] = msgspec.field(default_factory=dict)  # the plugin's own parameters (docs/routing.md)


class LongPrefillLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine's own prefill-guard limits (`routing.flow_control.engines.<backend>`); unset fields inherit."""

    long_prompt_tokens: int | None = None  # uncached prompt tokens from which a prompt is long on this engine
    max_long_prefills: int | None = None  # long prompts prefilling on this engine at once
    max_long_prefill_tokens: int | None = None  # their uncached tokens together


class ModelValidity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`routing.model_validity`: when the gateway trusts its model of an engine (gateway/routing/mode.py)."""

    min_observations: int = 16  # out-of-sample TTFTs since the learner's last reset
    max_mdare: float = 0.5  # median |actual - predicted| / actual of the recent ones
    exit_factor: float = 1.25  # a modelled engine becomes pass-through past max_mdare x this
    telemetry_fresh_s: float = 5.0  # the last healthy metrics scrape may be this old


class FlowControlConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`routing.flow_control`: the gateway holds what the engines cannot start soon, in fair queues per priority
    class (weighted by policy `set: {share: N}`), and guards prefill against long prompts (docs/flow_control.md)."""

    enabled: bool = True
    # an engine takes another request from the gateway's queues while the prefill already queued on it is
    # predicted to take at most this long (its learned prefill rate); beyond it, requests wait in the gateway
    engine_queue_ms: float = 100.0
    max_queue_per_flow: int = 128  # requests one flow (tenant, team or partner) may have waiting per class
    max_wait_s: float = 30.0  # the longest a request without a TTFT target waits in the gateway
    tick_ms: float = 10.0  # how often a non-empty queue re-checks the engines between finishes
    prefill_token_weight: float = 1.0  # a flow's virtual counter: uncached prompt tokens served x this ...
    decode_token_weight: float = 1.0  # ... plus completion tokens served x this
    # the prefill guard: a prompt is long from this many uncached tokens (null: 2 x the engine's chunk budget
    # once configured or learned, 4096 until then)
    long_prompt_tokens: int | None = None
    max_long_prefills: int = 1  # per engine: long prompts prefilling at once
    max_long_prefill_tokens: int | None = None  # per engine: their uncached tokens together (null: count only)
    long_engine_share: float = 0.5  # at most this share of a request's allowed engines prefill long prompts at once (at least one)
    long_context_engines: list[str] = msgspec.field(default_factory=list)  # backends long prompts go to, when allowed
    long_ttft_slo_ms: float | None = None  # a long prompt's target when policy sets none (null: its target + its own unloaded prefill)
    engines: dict[str, LongPrefillLimits] = msgspec.field(default_factory=dict)  # per backend, wins over the above


class PeersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`routing.peers`: replicas route as one. Each publishes its dispatches, first tokens, finishes, TTFT
    learner samples and session affinity; the others count that work in their views of the engines
    (docs/scale_out.md#replicas). Read at start: a change takes a restart."""

    # auto: Redis when redis_url is set or budgets.store is redis, else Postgres LISTEN/NOTIFY when
    # identity.store is postgres, else the local bus of `gateway serve --workers N` (GATEWAY_PEER_DIR), else off
    # (each replica sees the others only in the engines' metrics)
    mode: str = "auto"  # auto | redis | postgres | local | off
    redis_url: str | None = None  # null: budgets.redis_url (when budgets.store is redis, or mode is redis)
    # the Redis (or Postgres) channel; replicas that route one fleet share it. null: "<budgets.key_prefix>:peers"
    # (Postgres: "<budgets.key_prefix>_peers"), so deployments kept apart on one store stay apart here too
    channel: str | None = None
    flush_ms: float = 2.0  # events are sent in batches at most this long after the first of them
    # how often the streams this replica published are checked for their first token (then told to the peers)
    first_token_poll_ms: float = 10.0
    heartbeat_s: float = 0.5  # an idle replica still says it is alive this often
    peer_timeout_s: float = 3.0  # a replica not heard this long is gone: its flights stop counting
    flight_ttl_s: float = 600.0  # a remote flight without its finish stops counting after this long
    share_learning: bool = True  # the TTFT learner learns from the other replicas' samples too
    share_affinity: bool = True  # a session's engine is remembered across replicas


class RoutingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # strategy presets: predicted_ttft | least_loaded | round_robin | prefix_hash | target_fit (docs/routing.md)
    strategy: str | list[PluginSpec] = "predicted_ttft"  # a preset or a list of {type, weight, params}
    default_ttft_slo_ms: float | None = None
    admission: bool = True
    batch_queue_size: int = 256
    batch_queue_timeout_s: float = 30.0
    affinity_headers: list[str] = msgspec.field(default_factory=lambda: ["x-session-id", "x-opper-trace-id"])
    # --- added by the predictive router
    admission_quantile: float = 0.9  # the calibrated upper quantile of the TTFT prediction admission checks
    batch_headroom: float = 0.5  # batch is admitted only while the best upper prediction is under this x target
    batch_ttft_target_ms: float | None = None  # batch's own target when it has none (default: none -> admit)
    affinity_slack_ms: float = 15.0  # a session's previous engine wins when within this (or affinity_rel) of best
    affinity_rel: float = 0.1
    priority_values: dict[str, int] = msgspec.field(
        default_factory=lambda: {"realtime": 0, "standard": 5, "batch": 10})  # vLLM priority: lower runs first
    cache_salt_secret_env: str | None = None  # keys the per-tenant cache_salt; default: a fixed gateway secret
    cold_margin: float = 0.5  # upper = mean x (1 + cold_margin) until an engine has min_samples observations
    # the engines' chunked-prefill token budget per step (vLLM --max-num-batched-tokens): the view drains queued
    # prefill in chunks of this size. Per backend name when configured, else learned from the engine's KV events,
    # else the default (shown as "assumed" in /admin/routing until the engine showed its budget)
    prefill_token_budget: int = 8192  # assumed until learned from the engine's KV events
    prefill_token_budgets: dict[str, int] = msgspec.field(default_factory=dict)  # per backend; wins over learned
    # predicted_ttft only: best-fit placement by TTFT target (gateway/routing/scorers/target_fit.py); off by default
    target_fit: bool = False  # send a request with a target to the engine meeting 0.6 x it with least slack
    flow_control: FlowControlConfig = msgspec.field(default_factory=FlowControlConfig)
    # when an engine counts as modelled (prediction, admission, flow control and the prefill guard act on it)
    model_validity: ModelValidity = msgspec.field(default_factory=ModelValidity)
    peers: PeersConfig = msgspec.field(default_factory=PeersConfig)  # replicas route as one (docs/scale_out.md)

    def strategy_error(self) -> tuple[str, str] | None:
        """(key under `routing.`, why) when the strategy cannot be built (gateway.config names file:line)."""
        bad = registry.strategy_error(self.strategy)
        if bad is None and self.peers.mode not in ("auto", "redis", "postgres", "local", "off"):
            return "peers.mode", f"must be auto, redis, postgres, local or off, not {self.peers.mode!r}"
        if bad is None and not (self.peers.heartbeat_s > 0 and self.peers.peer_timeout_s > self.peers.heartbeat_s):
            return "peers.peer_timeout_s", "must be longer than peers.heartbeat_s (> 0)"
        if bad is None and self.target_fit and not isinstance(self.strategy, str):
            return "target_fit", "applies to the predicted_ttft preset only: list a target_fit scorer instead"
        return bad
