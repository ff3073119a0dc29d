{{/* Names, labels and shared pieces of the expertcache chart. */}}

{{- define "expertcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "expertcache.fullname" -}}
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

{{/* Labels that select one component: dict "ctx" $ "component" "gpu|predictor|redis". */}}
{{- define "expertcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "expertcache.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "expertcache.labels" -}}
{{ include "expertcache.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: expertcache
{{- end -}}

{{- define "expertcache.image" -}}
{{- printf "%s:%s" (index .ctx.Values.images .name) (default .ctx.Chart.AppVersion .ctx.Values.images.tag) -}}
{{- end -}}

{{- define "expertcache.serviceAccountName" -}}
{{- if .Values.liveConfig.watchApi -}}{{ include "expertcache.fullname" . }}{{- else -}}default{{- end -}}
{{- end -}}

{{/* Address of the predictor Service as compute and the daemon dial it. */}}
{{- define "expertcache.predictorAddress" -}}
{{- printf "%s-predictor:%d" (include "expertcache.fullname" .) (int .Values.predictor.port) -}}
{{- end -}}

{{- define "expertcache.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis-0.%s-redis:%d/0" (include "expertcache.fullname" .) (include "expertcache.fullname" .) (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the Redis password (name and key), or nothing. */}}
{{- define "expertcache.redisPasswordSecret" -}}
{{- if .Values.redis.enabled -}}
{{- with .Values.redis.auth.existingSecret -}}{{ . }}{{- end -}}
{{- else -}}
{{- with .Values.redis.external.passwordSecret.name -}}{{ . }}{{- end -}}
{{- end -}}
{{- end -}}

{{- define "expertcache.redisPasswordKey" -}}
{{- if .Values.redis.enabled -}}{{ .Values.redis.auth.secretKey }}{{- else -}}{{ .Values.redis.external.passwordSecret.key }}{{- end -}}
{{- end -}}

{{/* A Kubernetes memory quantity ("24Gi", "512M", "1.5Gi", "1073741824") in bytes, as an int64:
dict "name" <the value's name, for messages> "value" <the quantity>. */}}
{{- define "expertcache.bytes" -}}
{{- $q := toString .value -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- if not $num -}}{{- fail (printf "%s: cannot read %q as a memory quantity (e.g. 24Gi)" .name $q) -}}{{- end -}}
{{- $unit := trimPrefix $num $q -}}
{{- $mult := dict "" 1 "k" 1000 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if not (hasKey $mult $unit) -}}{{- fail (printf "%s: cannot read %q as a memory quantity: unknown unit %q (use Ki, Mi, Gi, Ti, k, M, G, T)" .name $q $unit) -}}{{- end -}}
{{- mulf (float64 $num) (index $mult $unit) | int64 -}}
{{- end -}}

{{/* securityContext of every container. */}}
{{- define "expertcache.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* A probe: dict "probe" <values> "action" <yaml of the handler>. */}}
{{- define "expertcache.probe" -}}
{{ .action }}
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
{{- end -}}

{{/* Probe handler of a gRPC server on `port`: native gRPC, or `expertcache health` over TLS. */}}
{{- define "expertcache.grpcProbeAction" -}}
{{- if .ctx.Values.tls.enabled -}}
exec:
  command:
    - expertcache
    - health
    - --address=127.0.0.1:{{ .port }}
    - --tls-ca-file=/etc/expertcache/tls/ca.crt
    {{- if .ctx.Values.tls.mutual }}
    - --tls-cert-file=/etc/expertcache/tls/tls.crt
    - --tls-key-file=/etc/expertcache/tls/tls.key
    {{- end }}
    {{- with .ctx.Values.tls.serverName }}
    - --tls-server-name={{ . }}
    {{- end }}
    {{- if .ctx.Values.tls.authTokenSecret }}
    - --auth-token-file=/etc/expertcache/auth/token
    {{- end }}
{{- else -}}
grpc:
  port: {{ .port }}
{{- end -}}
{{- end -}}

{{/* Probe handler of compute: its gRPC health, or GET /health of the HTTP front door. */}}
{{- define "expertcache.computeProbeAction" -}}
{{- if and .Values.compute.http.enabled .Values.compute.http.healthProbes -}}
httpGet:
  path: /health
  port: http
{{- if .Values.tls.enabled }}
  scheme: HTTPS
{{- end }}
{{- else -}}
{{- include "expertcache.grpcProbeAction" (dict "ctx" . "port" .Values.compute.port) -}}
{{- end -}}
{{- end -}}

{{/* Volumes and mounts of TLS material (contract paths /etc/expertcache/tls, /etc/expertcache/auth). */}}
{{- define "expertcache.tlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if .Values.tls.authTokenSecret }}
- name: auth
  secret:
    secretName: {{ .Values.tls.authTokenSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "expertcache.tlsMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/expertcache/tls
  readOnly: true
{{- end }}
{{- if .Values.tls.authTokenSecret }}
- name: auth
  mountPath: /etc/expertcache/auth
  readOnly: true
{{- end }}
{{- end -}}

{{/* Flags of a TLS server (compute, predictor). */}}
{{- define "expertcache.tlsServerArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert-file=/etc/expertcache/tls/tls.crt
- --tls-key-file=/etc/expertcache/tls/tls.key
{{- if .Values.tls.mutual }}
- --tls-client-ca-file=/etc/expertcache/tls/ca.crt
{{- end }}
{{- end }}
{{- if .Values.tls.authTokenSecret }}
- --auth-token-file=/etc/expertcache/auth/token
{{- end }}
{{- end -}}

{{/* Flags of a predictor client (compute, daemon). */}}
{{- define "expertcache.predictorClientArgs" -}}
{{- if .Values.tls.enabled }}
- --predictor-tls-ca-file=/etc/expertcache/tls/ca.crt
{{- if .Values.tls.mutual }}
- --predictor-tls-cert-file=/etc/expertcache/tls/tls.crt
- --predictor-tls-key-file=/etc/expertcache/tls/tls.key
{{- end }}
{{- end }}
{{- if .Values.tls.authTokenSecret }}
- --predictor-auth-token-file=/etc/expertcache/auth/token
{{- end }}
{{- end -}}

{{/* Environment shared by every service container. */}}
{{- define "expertcache.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{/* A config map as YAML, whole numbers written as integers (values files read them as floats). */}}
{{- define "expertcache.configYaml" -}}
{{- $out := dict -}}
{{- range $key, $value := . -}}
{{- $_ := set $out $key $value -}}
{{- if kindIs "float64" $value -}}
{{- if eq (floor $value) $value -}}
{{- $_ = set $out $key (int64 $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The predictor's memory bounds against the chart's limits, as JSON (ints): plimit, rlimit
(0 with an external Redis), fixed (overhead + live + pending inserts + subscriber queues),
eamc (predictor.config.max_eamc_bytes, else derived: the most that fits both), derived (true
when derived), largest (bytes one model of max_layers x max_experts reserves). In the predictor
the EAMC takes 1.25x its reservation (float32 and 4-bit rows); in Redis 2.5x (entries and a
change log of as many blobs, each up to 1.25x by allocator rounding). The defaults are
PredictorConfig's (predictor_svc/config.py). */}}
{{- define "expertcache.predictorBudgets" -}}
{{- $p := .Values.predictor -}}
{{- $cfg := default dict $p.config -}}
{{- $limits := default dict $p.resources.limits -}}
{{- if not $limits.memory -}}
{{- fail "predictor.resources.limits.memory must be set: the predictor's EAMC and live-request bounds are checked against it" -}}
{{- end -}}
{{- $plimit := include "expertcache.bytes" (dict "name" "predictor.resources.limits.memory" "value" $limits.memory) | int64 -}}
{{- $live := int64 (default 1073741824 $cfg.max_live_bytes) -}}
{{- $pending := int64 (default 268435456 $cfg.max_pending_insert_bytes) -}}
{{- $subs := mul (int64 (default 128 $cfg.max_subscribers)) (int64 (default 8388608 $cfg.subscriber_queue_bytes)) -}}
{{- $fixed := add (int64 $p.memoryOverheadBytes) $live $pending $subs -}}
{{- $eamc := div (mul (sub $plimit $fixed) 4) 5 -}}
{{- $rlimit := 0 -}}
{{- if .Values.redis.enabled -}}
{{- $rl := default dict .Values.redis.resources.limits -}}
{{- if not $rl.memory -}}
{{- fail "redis.resources.limits.memory must be set: the predictor's EAMC bound is checked against it" -}}
{{- end -}}
{{- $rlimit = include "expertcache.bytes" (dict "name" "redis.resources.limits.memory" "value" $rl.memory) | int64 -}}
{{- $eamc = min $eamc (div (mul (sub $rlimit (int64 .Values.redis.memoryOverheadBytes)) 2) 5) -}}
{{- end -}}
{{- $derived := kindIs "invalid" $cfg.max_eamc_bytes -}}
{{- if not $derived -}}{{- $eamc = int64 $cfg.max_eamc_bytes -}}{{- end -}}
{{- $cells := mul (int64 (default 256 $cfg.max_layers)) (int64 (default 1024 $cfg.max_experts)) -}}
{{- $largest := mul (int64 (default 512 $cfg.eamc_capacity)) (add 24 (mul 4 $cells)) -}}
{{- toJson (dict "plimit" $plimit "rlimit" $rlimit "fixed" $fixed "live" $live "pending" $pending "subs" $subs "eamc" $eamc "derived" $derived "largest" $largest) -}}
{{- end -}}

{{/* Security flags of the test hook's client commands: the probes' (same Secrets, same paths),
the token whenever the release requires one. */}}
{{- define "expertcache.testClientArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-ca-file=/etc/expertcache/tls/ca.crt
{{- if .Values.tls.mutual }}
- --tls-cert-file=/etc/expertcache/tls/tls.crt
- --tls-key-file=/etc/expertcache/tls/tls.key
{{- end }}
{{- with .Values.tls.serverName }}
- --tls-server-name={{ . }}
{{- end }}
{{- end }}
{{- if .Values.tls.authTokenSecret }}
- --auth-token-file=/etc/expertcache/auth/token
{{- end }}
{{- end -}}

{{/* What every container of the test hook has besides its image and command. */}}
{{- define "expertcache.testContainer" -}}
securityContext:
  {{- include "expertcache.containerSecurityContext" . | nindent 2 }}
resources:
  {{- toYaml .Values.tests.resources | nindent 2 }}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  {{- with (include "expertcache.tlsMounts" . | trim) }}{{ . | nindent 2 }}{{ end }}
{{- end -}}
