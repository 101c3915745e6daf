{{- define "specpipe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specpipe.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 57 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 57 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 57 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The stage StatefulSet and its headless Service share this name (pods: NAME-0, NAME-1, ...). */}}
{{- define "specpipe.stageName" -}}
{{- printf "%s-stage" (include "specpipe.fullname" .) -}}
{{- end -}}

{{/* At most 63 characters (a Service name), also for a long release name. */}}
{{- define "specpipe.coordinatorName" -}}
{{- printf "%s-coordinator" (include "specpipe.fullname" . | trunc 51 | trimSuffix "-") -}}
{{- end -}}

{{/* The coordinator's metrics Service: apart from the public API's, so a LoadBalancer never exposes it. */}}
{{- define "specpipe.metricsServiceName" -}}
{{- printf "%s-metrics" (include "specpipe.coordinatorName" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{- define "specpipe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specpipe.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "specpipe.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "specpipe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selectorLabels: call with (dict "ctx" $ "component" "stage") */}}
{{- define "specpipe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specpipe.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "specpipe.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The stage DNS name of ordinal i: call with (dict "ctx" $ "i" "{i}") */}}
{{- define "specpipe.stageAddress" -}}
{{- $s := include "specpipe.stageName" .ctx -}}
{{- printf "%s-%s.%s.%s.svc.cluster.local:%d" $s (toString .i) $s .ctx.Release.Namespace (int .ctx.Values.stages.port) -}}
{{- end -}}

{{/* The --model argument every pod passes. */}}
{{- define "specpipe.modelRef" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "hub" -}}{{ required "model.hub.id is required with model.source=hub (a Hugging Face hub id, e.g. meta-llama/Llama-3.1-8B-Instruct)" $m.hub.id }}
{{- else if eq $m.source "default" -}}default
{{- else -}}{{ trimSuffix "/" (printf "%s/%s" $m.mountPath $m.path) }}
{{- end -}}
{{- end -}}

{{/* The --draft-model argument (draft: model): a folder in the model volume (pvc, hostPath), else a hub id. */}}
{{- define "specpipe.draftModelRef" -}}
{{- $c := .Values.coordinator -}}
{{- if has .Values.model.source (list "pvc" "hostPath") -}}{{ printf "%s/%s" .Values.model.mountPath $c.draftModelPath }}
{{- else -}}{{ $c.draftModelPath }}
{{- end -}}
{{- end -}}

{{/* Volumes of every server pod: the model (pvc or hostPath) and /tmp (the root filesystem is read-only).
     The cache volume is specpipe.cacheVolume (a stage may have it from a volumeClaimTemplate). */}}
{{- define "specpipe.modelVolumes" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
# hostPath: refused by the baseline and restricted Pod Security Standards (helm/README.md)
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}
    type: Directory
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end -}}

{{/* The cache volume (hub downloads in HF_HOME, the converted default model in SPECPIPE_CACHE): an existing
     claim (model.hub.cache.claimName) or an emptyDir. */}}
{{- define "specpipe.cacheVolume" -}}
{{- $cache := .Values.model.hub.cache -}}
- name: cache
{{- if $cache.claimName }}
  persistentVolumeClaim:
    claimName: {{ $cache.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $cache.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "specpipe.modelMounts" -}}
{{- if has .Values.model.source (list "pvc" "hostPath") }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
- name: cache
  mountPath: /cache
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* Environment shared by every container: logs, HOME and caches (all on writable volumes), hub token. */}}
{{- define "specpipe.commonEnv" -}}
- name: SPECPIPE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: HOME
  value: /tmp
- name: SPECPIPE_CACHE
  value: /cache/specpipe
- name: HF_HOME
  value: /cache/hf
{{- if and (eq .Values.model.source "hub") .Values.model.hub.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hub.tokenSecret.name }}
      key: {{ .Values.model.hub.tokenSecret.key }}
{{- end }}
{{- end -}}

{{/* Labels of a workload's pods: the chart's (which win) and podLabels: call with (dict "ctx" $ "component" C
     "extra" PODLABELS) */}}
{{- define "specpipe.podLabels" -}}
{{- $own := fromYaml (include "specpipe.labels" .ctx) -}}
{{- $_ := set $own "app.kubernetes.io/component" .component -}}
{{- toYaml (mergeOverwrite (deepCopy (default dict .extra)) $own) -}}
{{- end -}}

{{/* A securityContext: the chart-wide one with a workload's override merged over it (call with
     (dict "base" .Values.podSecurityContext "override" $c.podSecurityContext)); the defaults meet the
     restricted Pod Security Standard. */}}
{{- define "specpipe.securityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy (default dict .base)) (deepCopy (default dict .override))) -}}
{{- end -}}

{{/* Scheduling and runtime fields of a pod spec: call with (dict "w" .Values.stages "ctx" $ "component" C) */}}
{{- define "specpipe.podScheduling" -}}
{{- with .w.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .w.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .w.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- with .w.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .w.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .w.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .w.topologySpreadConstraints }}
{{- $selector := dict "matchLabels" (fromYaml (include "specpipe.selectorLabels" (dict "ctx" .ctx "component" .component))) }}
{{- $spread := list }}
{{- range .w.topologySpreadConstraints }}
{{- /* a constraint without labelSelector spreads this workload's own pods */}}
{{- $t := deepCopy . }}
{{- if not (hasKey $t "labelSelector") }}{{ $_ := set $t "labelSelector" $selector }}{{ end }}
{{- $spread = append $spread $t }}
{{- end }}
topologySpreadConstraints:
  {{- toYaml $spread | nindent 2 }}
{{- end }}
{{- end -}}

{{/* resources plus the GPU: call with (dict "resources" .resources "gpu" .gpu) */}}
{{- define "specpipe.resources" -}}
{{- $r := deepCopy (default dict .resources) -}}
{{- if gt (int .gpu.count) 0 -}}
{{- $limits := default dict (get $r "limits") -}}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) -}}
{{- $_ := set $r "limits" $limits -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* NetworkPolicy ingress rule of a metrics port: from networkPolicy.metricsFrom, or any pod.
     Call with (dict "ctx" $ "port" P) */}}
{{- define "specpipe.metricsIngress" -}}
{{- if .ctx.Values.metrics.enabled -}}
- ports:
    - port: {{ .port }}
      protocol: TCP
  {{- with .ctx.Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Secret of the stages' certificate for the internal mutual TLS (the coordinator's: _tls.tpl) */}}
{{- define "specpipe.tlsSecret" -}}
{{- default (printf "%s-tls" (include "specpipe.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{/* Arguments that turn mutual TLS on for the internal hops (one certificate as server and client) */}}
{{- define "specpipe.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert=/etc/specpipe/tls/tls.crt
- --tls-key=/etc/specpipe/tls/tls.key
- --tls-ca=/etc/specpipe/tls/ca.crt
{{- end }}
{{- end -}}

{{- define "specpipe.tlsMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/specpipe/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The coordinator's TLS volume: its own certificate (the stages use specpipe.stageTlsVolumes) */}}
{{- define "specpipe.tlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "specpipe.coordinatorTlsSecret" . }}
{{- end }}
{{- end -}}

{{/* gRPC probes on `port`, or on the plaintext health port when the main port requires TLS:
     call with (dict "port" P "tls" BOOL "healthPort" H "startupSeconds" S) */}}
{{- define "specpipe.probes" -}}
{{- $port := ternary .healthPort .port .tls -}}
startupProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 10
  failureThreshold: {{ max 1 (div (int .startupSeconds) 10) }}
readinessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* The kubelet probes the plaintext health port (it serves grpc.health.v1 only) */}}
{{- define "specpipe.healthIngress" -}}
{{- if .Values.tls.enabled -}}
- ports:
    - port: {{ .Values.tls.healthPort }}
      protocol: TCP
{{- end -}}
{{- end -}}
