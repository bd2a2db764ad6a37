"""Zero retention covers the pooling APIs' content too: a rerank query and documents, score's text pairs are
never left in an audit record (even quoted in an error) nor in a log line during the request."""
from __future__ import annotations

import orjson

from gateway.evidence.recorder import build_record
from gateway.observability.logs import zero_retention_content
from gateway.pipeline import RequestContext

QUERY = "CANARY-QUERY-7f3a which contract clause"
DOC = "CANARY-DOC-91be the clause says"
T1, T2 = "CANARY-T1-55aa left text", "CANARY-T2-66bb right text"


def test_rerank_and_score_texts_are_scrubbed_from_records():
    for endpoint, body in (("rerank", {"model": "m", "query": QUERY, "documents": [DOC, "another document"]}),
                           ("score", {"model": "m", "text_1": T1, "text_2": T2})):
        ctx = RequestContext(request_id="req_1", endpoint=endpoint, headers={}, body=body)  # no decision: zero
        ctx.evidence["upstream"] = {"message": f"could not score '{QUERY if endpoint == 'rerank' else T1}'",
                                    "documents": [DOC]}
        ctx.error = "upstream_rejected"
        raw = orjson.dumps(build_record(ctx, capture_content=True)).decode()
        assert "CANARY" not in raw, raw


def test_log_filter_knows_the_pooling_content():
    ctx = RequestContext(request_id="req_1", endpoint="rerank", headers={},
                         body={"model": "m", "query": QUERY, "documents": [DOC]})
    got = zero_retention_content(ctx)
    assert QUERY in got and DOC in got
    ctx = RequestContext(request_id="req_1", endpoint="score", headers={}, body={"model": "m", "text_1": T1,
                                                                                 "text_2": [T2]})
    assert {T1, T2} <= set(zero_retention_content(ctx))
