{{/* Names and labels. */}}
{{- define "gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gateway.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gateway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "gateway.engineSelectorBase" -}}
app.kubernetes.io/name: {{ include "gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: engine
{{- end -}}

{{- define "gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gateway.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Engine object/Service name for an engine entry: (dict "root" $ "e" $engine). */}}
{{- define "gateway.engineName" -}}
{{- printf "%s-engine-%s" (include "gateway.fullname" .root) .e.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The host other pods use to reach an engine's Service. */}}
{{- define "gateway.engineHost" -}}
{{- printf "%s.%s.svc" (include "gateway.engineName" .) .root.Release.Namespace -}}
{{- end -}}

{{/* Replicas that can run at once: HPA max or replicaCount. */}}
{{- define "gateway.maxReplicas" -}}
{{- if .Values.autoscaling.enabled -}}{{ int .Values.autoscaling.maxReplicas }}{{- else -}}{{ int .Values.replicaCount }}{{- end -}}
{{- end -}}

{{- define "gateway.redisEnabled" -}}
{{- if or .Values.externalRedis.host .Values.evaluation.redis.enabled -}}true{{- end -}}
{{- end -}}

{{- define "gateway.postgresEnabled" -}}
{{- if or .Values.externalPostgres.existingSecret .Values.evaluation.postgres.enabled -}}true{{- end -}}
{{- end -}}

{{- define "gateway.redisUrl" -}}
{{- if .Values.externalRedis.host -}}
{{- printf "%s://%s:%d/%d" (ternary "rediss" "redis" .Values.externalRedis.tls) .Values.externalRedis.host (int .Values.externalRedis.port) (int .Values.externalRedis.db) -}}
{{- else -}}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "gateway.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Secret (name, key) holding the Postgres DSN. */}}
{{- define "gateway.postgresSecretName" -}}
{{- if .Values.externalPostgres.existingSecret -}}{{ .Values.externalPostgres.existingSecret }}{{- else -}}{{ include "gateway.fullname" . }}-postgres{{- end -}}
{{- end -}}
{{- define "gateway.postgresSecretKey" -}}
{{- if .Values.externalPostgres.existingSecret -}}{{ .Values.externalPostgres.dsnKey }}{{- else -}}dsn{{- end -}}
{{- end -}}

{{/* Refusals: a chart that renders must describe a deployment whose state is consistent. */}}
{{- define "gateway.validate" -}}
{{- if and (gt (int (include "gateway.maxReplicas" .)) 1) (not (and (include "gateway.redisEnabled" .) (include "gateway.postgresEnabled" .))) -}}
{{- fail "replicas > 1 (or autoscaling) needs shared state: set externalRedis.host and externalPostgres.existingSecret (or evaluation.redis.enabled and evaluation.postgres.enabled). Budgets held in one replica's memory and keys in one replica's SQLite would not be exact across replicas." -}}
{{- end -}}
{{- if and .Values.persistence.enabled (gt (int (include "gateway.maxReplicas" .)) 1) (not .Values.persistence.existingClaim) -}}
{{- fail "persistence.enabled with more than one replica (or autoscaling) would mount one ReadWriteOnce claim in every replica: state shared across replicas lives in Redis/Postgres, so keep persistence for single-replica installs (or give an existingClaim you know is ReadWriteMany)" -}}
{{- end -}}
{{- if hasKey .Values.gateway.config "backends" -}}
{{- fail "gateway.config.backends is not allowed: engines come from engines.list, other routes from gateway.backends" -}}
{{- end -}}
{{- $p := .Values.engines.ports -}}
{{- if or (eq (int $p.http) (int $p.kvEvents)) (eq (int $p.http) (int $p.replay)) (eq (int $p.kvEvents) (int $p.replay)) -}}
{{- fail "engines.ports.http, kvEvents and replay must differ" -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $e := .Values.engines.list -}}
{{- if hasKey $seen $e.name -}}{{- fail (printf "engines.list: duplicate engine name %q" $e.name) -}}{{- end -}}
{{- $_ := set $seen $e.name true -}}
{{- end -}}
{{- range $b := .Values.gateway.backends -}}
{{- if hasKey $seen $b.name -}}{{- fail (printf "gateway.backends: %q is also an engine name" $b.name) -}}{{- end -}}
{{- $_ := set $seen $b.name true -}}
{{- end -}}
{{- end -}}

{{/* vLLM --kv-events-config for the engine: binds on all interfaces; the gateway connects to the Service. */}}
{{- define "gateway.kvEventsConfig" -}}
{{- $p := .Values.engines.ports -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $p.kvEvents)) "replay_endpoint" (printf "tcp://*:%d" (int $p.replay)) "topic" .Values.engines.kvTopic | toJson -}}
{{- end -}}
