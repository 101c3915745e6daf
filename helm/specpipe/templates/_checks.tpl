{{/* Value combinations that cannot work are refused at render, each with what to change.
     Included once, by the coordinator's Deployment (always rendered). */}}
{{- define "specpipe.checks" -}}
{{- $c := .Values.coordinator -}}
{{- $v := .Values.stages -}}
{{- if and $c.apiTokenSecret.name (not $c.apiTlsSecret) (not $c.allowTokenWithoutTls) }}
{{- fail "coordinator.apiTokenSecret needs coordinator.apiTlsSecret: without TLS the bearer token crosses the network in plaintext (and `specpipe generate`, which `helm test` runs, refuses to send it). Set coordinator.apiTlsSecret, or coordinator.allowTokenWithoutTls=true on a network you trust (e.g. a mesh that encrypts pod traffic)" }}
{{- end }}
{{- if and .Values.tests.caSecret.name (not $c.apiTlsSecret) }}
{{- fail "tests.caSecret is the CA of the API's TLS certificate: it needs coordinator.apiTlsSecret" }}
{{- end }}
{{- if and (eq $c.draft "model") (not $c.draftModelPath) }}
{{- fail "coordinator.draft=model needs coordinator.draftModelPath (a folder in the model volume with model.source pvc or hostPath, else a hub id)" }}
{{- end }}
{{- $ports := dict -}}
{{- $_ := set $ports "coordinator.port" (int $c.port) -}}
{{- $_ := set $ports "tls.healthPort" (int .Values.tls.healthPort) -}}
{{- if $c.httpPort }}{{ $_ := set $ports "coordinator.httpPort" (int $c.httpPort) }}{{ end -}}
{{- if .Values.metrics.enabled }}{{ $_ := set $ports "coordinator.metricsPort" (int $c.metricsPort) }}{{ end -}}
{{- $seen := dict -}}
{{- range $name := keys $ports | sortAlpha }}
{{- $p := toString (get $ports $name) }}
{{- if hasKey $seen $p }}
{{- fail (printf "%s and %s are both %s: the coordinator's ports must differ" (get $seen $p) $name $p) }}
{{- end }}
{{- $_ := set $seen $p $name }}
{{- end }}
{{- if and .Values.tls.enabled (eq (int $v.port) (int .Values.tls.healthPort)) }}
{{- fail "tls.healthPort must differ from stages.port" }}
{{- end }}
{{- if and .Values.tls.enabled .Values.metrics.enabled (eq (int $v.metricsPort) (int .Values.tls.healthPort)) }}
{{- fail "tls.healthPort must differ from stages.metricsPort" }}
{{- end }}
{{- end -}}
