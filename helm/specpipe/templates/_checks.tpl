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
{{- $t := .Values.tls -}}
{{- if $t.certManager.perPod }}
{{- $stage := include "specpipe.stageName" . }}
{{- if not $t.enabled }}
{{- fail "tls.certManager.perPod needs tls.enabled=true: the per-pod certificates are those of the internal mutual TLS" }}
{{- end }}
{{- if not $t.certManager.enabled }}
{{- fail "tls.certManager.perPod needs tls.certManager.enabled=true: its issuerRef signs the per-pod certificates (cert-manager csi-driver) and the coordinator's Certificate" }}
{{- end }}
{{- if not $t.certManager.issuerRef.name }}
{{- fail "tls.certManager.perPod needs tls.certManager.issuerRef.name: the issuer the csi-driver asks for each stage pod's certificate" }}
{{- end }}
{{- if $t.stageName }}
{{- fail (printf "tls.stageName names the shared stage certificate; with tls.certManager.perPod each stage is named by its pod (%s-<ordinal>): leave tls.stageName empty" $stage) }}
{{- end }}
{{- if $t.secretName }}
{{- fail "tls.secretName is the shared stage Secret; with tls.certManager.perPod the stages mount per-pod certificates from the csi-driver and no Secret: leave tls.secretName empty" }}
{{- end }}
{{- $coordId := include "specpipe.tlsCoordinatorIdentity" . }}
{{- if regexMatch (printf "^%s-[0-9]+$" (regexQuoteMeta $stage)) $coordId }}
{{- fail (printf "tls.coordinatorName %s is the name of a stage pod (%s-<ordinal>): with tls.certManager.perPod that stage could Configure every other; choose another" $coordId $stage) }}
{{- end }}
{{- if gt (len $stage) 60 }}
{{- fail (printf "with tls.certManager.perPod the stage pods' names (%s-<ordinal>) are their certificates' common names, at most 64 characters: shorten the release name or set fullnameOverride" $stage) }}
{{- end }}
{{- if lt (int (include "specpipe.stageGroup" .)) 1 }}
{{- fail "tls.certManager.perPod needs the stages' group (podSecurityContext.fsGroup or runAsGroup, 1 or more, also via stages.podSecurityContext): the csi-driver writes the private key readable by that group (csi.cert-manager.io/fs-group) alone" }}
{{- end }}
{{- end }}
{{- if and .Values.tls.enabled (eq (int $v.port) (int .Values.tls.healthPort)) }}
{{- fail "tls.healthPort must differ from stages.port" }}
{{- end }}
{{- if and .Values.tls.enabled .Values.metrics.enabled (eq (int $v.metricsPort) (int .Values.tls.healthPort)) }}
{{- fail "tls.healthPort must differ from stages.metricsPort" }}
{{- end }}
{{- end -}}
