{{/* Identities of the internal mutual TLS: the names a stage checks in a peer's certificate (CN or SAN).
     The coordinator's may call every Stage RPC; a stage's only Forward (to the next stage) and Info. */}}
{{- define "specpipe.tlsCoordinatorIdentity" -}}
{{- default (include "specpipe.coordinatorName" .) .Values.tls.coordinatorName -}}
{{- end -}}

{{- define "specpipe.tlsStageIdentity" -}}
{{- default (include "specpipe.stageName" .) .Values.tls.stageName -}}
{{- end -}}

{{/* Secret of the coordinator's own certificate (the stages' is specpipe.tlsSecret) */}}
{{- define "specpipe.coordinatorTlsSecret" -}}
{{- default (printf "%s-coordinator-tls" (include "specpipe.fullname" .)) .Values.tls.coordinatorSecretName -}}
{{- end -}}

{{/* A stage's TLS arguments: its files, and which certificate names it serves */}}
{{- define "specpipe.stageTlsArgs" -}}
{{- if .Values.tls.enabled }}
{{- if eq (include "specpipe.tlsCoordinatorIdentity" .) (include "specpipe.tlsStageIdentity" .) }}
{{- fail "tls.coordinatorName and tls.stageName must differ: stages accept Configure/Results/Control only from the coordinator's name" }}
{{- end }}
{{- include "specpipe.tlsArgs" . }}
- --tls-coordinator-name={{ include "specpipe.tlsCoordinatorIdentity" . }}
- --tls-peer-names={{ include "specpipe.tlsStageIdentity" . }}
{{- end }}
{{- end -}}

{{/* The stages mount their own Secret (the coordinator's volume is specpipe.tlsVolumes) */}}
{{- define "specpipe.stageTlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "specpipe.tlsSecret" . }}
{{- end }}
{{- end -}}
