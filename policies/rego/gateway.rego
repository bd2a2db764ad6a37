# Example gateway policy for Open Policy Agent (queried at POST /v1/data/gateway/decision).
# Input document: see docs/policy.md ("OPA"). An undefined `decision` is a deny in the gateway.
package gateway

import rego.v1

eea := {
	"AT", "BE", "BG", "HR", "CY", "CZ", "DK", "EE", "FI", "FR", "DE", "GR", "HU", "IE",
	"IT", "LV", "LT", "LU", "MT", "NL", "PL", "PT", "RO", "SK", "SI", "ES", "SE", "IS", "LI", "NO",
}

frontier_prefixes := ["kimi-k3", "glm-5"]

denials contains {"rule": "secret-data-denied", "reason": "secret data must not be sent to any LLM"} if {
	input.request.headers["x-data-classification"] == "secret"
}

denials contains {"rule": "interns-no-frontier", "reason": "frontier models need a team budget owner"} if {
	"intern" in input.principal.scopes
	some p in frontier_prefixes
	startswith(input.request.model, p)
}

denials contains {"rule": "local-policy-denied", "reason": "the gateway's YAML policy denied"} if {
	input.local_decision.allow == false
}

# Partner contract: Opper traffic stays in the EEA with zero retention.
requirements := {"jurisdiction": "EEA", "retention": "zero", "priority": "standard", "ttft_slo_ms": 1500} if {
	input.principal.partner == "opper"
} else := {"jurisdiction": "EEA", "retention": "zero"} if {
	input.principal.labels.residency == "eea"
} else := {}

denied := [d | some d in denials]

# The decision is only defined for requests with a (non-empty) tenant; otherwise it is undefined, hence denied.
decision := object.union({"allow": true}, requirements) if {
	input.principal.tenant != ""
	count(denials) == 0
}

decision := {"allow": false, "rule": denied[0].rule, "reason": denied[0].reason} if {
	input.principal.tenant != ""
	count(denials) > 0
}
