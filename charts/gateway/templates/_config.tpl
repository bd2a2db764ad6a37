{{/*
gateway.yaml, generated from the same values that start the engines (templates/engines.yaml), so the
backend URLs, KV-event and replay endpoints, served model names and locations cannot disagree.
Every key here exists in gateway/config.py (forbid_unknown_fields); tests/charts parses the result.
*/}}
{{- define "gateway.configDict" -}}
{{- $v := .Values -}}
{{- $data := $v.gateway.dataDir -}}
{{- $p := $v.engines.ports -}}
{{- $backends := list -}}
{{- range $e := $v.engines.list -}}
{{- $host := include "gateway.engineHost" (dict "root" $ "e" $e) -}}
{{- $b := dict "name" $e.name "kind" "vllm" "url" (printf "http://%s:%d/v1" $host (int $p.http)) "models" (list $e.servedModelName) "kv_events" (printf "tcp://%s:%d" $host (int $p.kvEvents)) "replay" (printf "tcp://%s:%d" $host (int $p.replay)) "metrics" (printf "http://%s:%d/metrics" $host (int $p.http)) "location" $e.location "retention" (default $v.engines.retention $e.retention) "operator" "self" -}}
{{- if (ternary $e.priorityScheduling $v.engines.priorityScheduling (hasKey $e "priorityScheduling")) -}}{{- $_ := set $b "priority_scheduling" true -}}{{- end -}}
{{- $mml := default $v.engines.maxModelLen $e.maxModelLen -}}
{{- if $mml -}}{{- $_ := set $b "context_window" (int $mml) -}}{{- end -}}
{{- if $e.weight -}}{{- $_ := set $b "weight" $e.weight -}}{{- end -}}
{{- if gt (int (default 1 $e.replicas)) 1 -}}{{- $_ := set $b "discovery" (dict "dns" $host "refresh_s" $v.engines.discoveryRefreshSeconds) -}}{{- end -}}
{{- $backends = append $backends $b -}}
{{- end -}}
{{- range $b := $v.gateway.backends -}}
{{- $backends = append $backends $b -}}
{{- end -}}
{{- $cfg := dict "server" (dict "host" "0.0.0.0" "port" (int $v.gateway.port) "workers" (int $v.gateway.workers)) "backends" $backends "data_dir" $data -}}
{{- if $v.gateway.aliases -}}{{- $_ := set $cfg "aliases" $v.gateway.aliases -}}{{- end -}}
{{- if $v.admin.existingSecret -}}{{- $_ := set $cfg "admin" (dict "key_env" "GATEWAY_ADMIN_KEY") -}}{{- end -}}
{{- $identity := dict "sqlite_path" (printf "%s/gateway.db" $data) -}}
{{- $budgets := dict "sqlite_path" (printf "%s/budgets.db" $data) "spool_path" (printf "%s/ledger-spool.jsonl" $data) -}}
{{- if include "gateway.redisEnabled" . -}}
{{- $_ := set $budgets "store" "redis" -}}
{{- $_ := set $budgets "redis_url" (include "gateway.redisUrl" .) -}}
{{- end -}}
{{- if include "gateway.postgresEnabled" . -}}
{{- $_ := set $identity "store" "postgres" -}}
{{- $_ := set $identity "postgres_dsn_env" "GATEWAY_POSTGRES_DSN" -}}
{{- $_ := set $budgets "ledger" "postgres" -}}
{{- $_ := set $budgets "ledger_dsn" "${GATEWAY_POSTGRES_DSN}" -}}
{{- end -}}
{{- $policy := dict "audit_path" (printf "%s/audit.jsonl" $data) -}}
{{- if include "gateway.postgresEnabled" . -}}
{{- $_ := set $policy "audit_postgres_dsn" "${GATEWAY_POSTGRES_DSN}" -}}
{{- end -}}
{{- if $v.policies -}}{{- $_ := set $policy "files" (list "policies/*.yaml") -}}{{- end -}}
{{- if $v.engines.list -}}{{- $_ := set $cfg "telemetry" (dict "kv_topic" $v.engines.kvTopic) -}}{{- end -}}
{{- $_ := set $cfg "identity" $identity -}}
{{- $_ := set $cfg "budgets" $budgets -}}
{{- $_ := set $cfg "policy" $policy -}}
{{- $cfg = mustMergeOverwrite $cfg (deepCopy $v.gateway.config) -}}
{{- toYaml $cfg -}}
{{- end -}}
