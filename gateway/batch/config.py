"""Config section `batch:` (owned by the batch lane, gateway/batch)."""
from __future__ import annotations

import msgspec


class BatchConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The batch lane: OpenAI Files and Batch API, run in the fleet's spare capacity (docs/batch.md)."""

    enabled: bool = True  # serve /v1/files and /v1/batches and run batch jobs
    sqlite_path: str | None = None  # job, line and file state; null: batch.db beside identity.sqlite_path (Postgres when identity.store is postgres)
    max_file_bytes: int = 104857600  # largest upload; a larger one is refused with 413 (OpenAI: 200 MB)
    max_lines: int = 50000  # most request lines in one batch input file (OpenAI's limit)
    max_line_bytes: int = 1048576  # largest single request line (never above server.max_body_bytes)
    lease_s: float = 15.0  # a dispatched line's lease; a crashed replica's lines are taken over after it lapses
    max_attempts: int = 3  # tries per line for retryable upstream failures (502/503/504) before it fails
    min_concurrency: int = 1  # lines in flight per replica when the fleet has room, at the least
    max_concurrency: int = 64  # at the most (the controller moves between these, additive up, halving down)
    realtime_ttft_target_ms: float | None = None  # target realtime must keep; null: routing.default_ttft_slo_ms, else 1000
    headroom: float = 0.25  # batch lines are started only while the best predicted upper TTFT is below headroom x target (docs/benchmarks.md, "Batch lane")
    max_prefilling_per_engine: int = 1  # batch lines an engine may have before their first token; a line starts only on an engine with no realtime request before its first token (bench/batch_lane.py)
    clear_engines: int = 1  # own engines left with no prefill at all (realtime or batch) when a line starts, so routing has one without batch prefill for the next realtime request (at most the healthy engines - 1; 0: off)
    prefill_duty: float = 1.0  # most share of an engine's time its batch prefill may take: after a line starts there, the next waits its predicted prefill / prefill_duty (1.0: right after the last one prefilled; docs/batch.md for measured trade-offs)
    tick_s: float = 0.05  # scheduler period
    zero_retention_delete_after_s: float = 3600.0  # a zero-retention batch's files are deleted this long after it ends
    prefix_chars: int = 256  # lines whose prompts share this many leading characters are dispatched together
    max_stored_bytes_per_tenant: int = 10737418240  # bytes of files (inputs, outputs, error files) one tenant may keep, all replicas together; an upload past it is 413 storage_limit_exceeded (10 GiB: 100 uploads at max_file_bytes; docs/batch.md)
    max_files_per_tenant: int = 10000  # files one tenant may keep, all replicas together; an upload past it is 429 file_limit_exceeded (10000: one page of GET /v1/files lists them all)
    max_concurrent_uploads: int = 4  # uploads this process takes at once (each spooled to a temporary file, their lines checked one upload at a time in one thread); more are 429 too_many_uploads
    max_concurrent_uploads_per_tenant: int = 2  # of which one tenant's, so one tenant cannot take every upload slot
    upload_timeout_s: float = 600.0  # an upload's body must arrive within this (408), so a slow client does not hold a slot


def batch_error(bc: BatchConfig) -> tuple[str, str] | None:
    """(field, why) for the first value of `batch:` that cannot work, else None (gateway.config reports it
    with file:line)."""
    values = msgspec.structs.asdict(bc)
    for name in ("max_file_bytes", "max_lines", "max_line_bytes", "max_attempts", "min_concurrency", "prefix_chars",
                 "max_prefilling_per_engine", "max_stored_bytes_per_tenant", "max_files_per_tenant",
                 "max_concurrent_uploads", "max_concurrent_uploads_per_tenant"):
        if values[name] < 1:
            return name, "must be >= 1"
    if bc.max_concurrency < bc.min_concurrency:
        return "max_concurrency", f"must be >= min_concurrency ({bc.min_concurrency})"
    for name in ("lease_s", "tick_s", "headroom", "upload_timeout_s"):
        if not values[name] > 0:
            return name, "must be > 0"
    if bc.clear_engines < 0:
        return "clear_engines", "must be >= 0"
    if not 0 < bc.prefill_duty <= 1:
        return "prefill_duty", "must be > 0 and <= 1"
    if bc.realtime_ttft_target_ms is not None and not bc.realtime_ttft_target_ms > 0:
        return "realtime_ttft_target_ms", "must be > 0 (milliseconds) or null"
    if bc.zero_retention_delete_after_s < 0:
        return "zero_retention_delete_after_s", "must be >= 0 (seconds)"
    return None
