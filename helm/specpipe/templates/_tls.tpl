{{/* Identities of the internal mutual TLS: the names a stage checks in a peer's certificate (CN or SAN).
     The coordinator's may call every Stage RPC; a stage's only Forward (to the next stage) and Info. With
     tls.certManager.perPod each stage pod has its own certificate, named by the pod (specpipe.tlsStageTemplate),
     and stage i takes Forward only from pod i-1. */}}
{{- define "specpipe.tlsCoordinatorIdentity" -}}
{{- default (include "specpipe.coordinatorName" .) .Values.tls.coordinatorName -}}
{{- end -}}

{{- define "specpipe.tlsStageIdentity" -}}
{{- default (include "specpipe.stageName" .) .Values.tls.stageName -}}
{{- end -}}

{{/* tls.certManager.perPod in effect: "true" or empty */}}
{{- define "specpipe.tlsPerPod" -}}
{{- if and .Values.tls.enabled .Values.tls.certManager.perPod }}true{{ end -}}
{{- end -}}

{{/* The per-pod identities (--tls-peer-template): the stage pod names, {index} the ordinal = stage index */}}
{{- define "specpipe.tlsStageTemplate" -}}
{{- printf "%s-{index}" (include "specpipe.stageName" .) -}}
{{- end -}}

{{/* The group the stage process reads its per-pod key with: the stages' fsGroup, else runAsGroup (0: none) */}}
{{- define "specpipe.stageGroup" -}}
{{- $psc := mergeOverwrite (deepCopy (default dict .Values.podSecurityContext)) (deepCopy (default dict .Values.stages.podSecurityContext)) -}}
{{- int (coalesce $psc.fsGroup $psc.runAsGroup 0) -}}
{{- end -}}

{{/* Secret of the coordinator's own certificate (the stages' is specpipe.tlsSecret) */}}
{{- define "specpipe.coordinatorTlsSecret" -}}
{{- default (printf "%s-coordinator-tls" (include "specpipe.fullname" .)) .Values.tls.coordinatorSecretName -}}
{{- end -}}

{{/* A stage's TLS arguments: its files, and which certificate names it serves */}}
{{- define "specpipe.stageTlsArgs" -}}
{{- if include "specpipe.tlsPerPod" . }}
{{- include "specpipe.tlsArgs" . }}
- --tls-coordinator-name={{ include "specpipe.tlsCoordinatorIdentity" . }}
- --tls-peer-template={{ include "specpipe.tlsStageTemplate" . }}
{{- else if .Values.tls.enabled }}
{{- if eq (include "specpipe.tlsCoordinatorIdentity" .) (include "specpipe.tlsStageIdentity" .) }}
{{- fail "tls.coordinatorName and tls.stageName must differ: stages accept Configure/Results/Control only from the coordinator's name" }}
{{- end }}
{{- include "specpipe.tlsArgs" . }}
- --tls-coordinator-name={{ include "specpipe.tlsCoordinatorIdentity" . }}
- --tls-peer-names={{ include "specpipe.tlsStageIdentity" . }}
{{- end }}
{{- end -}}

{{/* The stages mount their own Secret (the coordinator's volume is specpipe.tlsVolumes), or with
     tls.certManager.perPod a certificate the cert-manager csi-driver issues for the pod when it starts: the
     driver puts the pod's name and namespace for ${POD_NAME} and ${POD_NAMESPACE}, and writes tls.crt, tls.key
     and ca.crt (the issuer's CA) readable by fs-group alone. */}}
{{- define "specpipe.stageTlsVolumes" -}}
{{- if include "specpipe.tlsPerPod" . }}
{{- $stage := include "specpipe.stageName" . }}
{{- $cm := .Values.tls.certManager }}
- name: tls
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ $cm.issuerRef.name | quote }}
      csi.cert-manager.io/issuer-kind: {{ $cm.issuerRef.kind | quote }}
      csi.cert-manager.io/issuer-group: {{ $cm.issuerRef.group | quote }}
      csi.cert-manager.io/common-name: "${POD_NAME}"
      csi.cert-manager.io/dns-names: {{ printf "${POD_NAME},${POD_NAME}.%s,${POD_NAME}.%s.${POD_NAMESPACE}.svc,${POD_NAME}.%s.${POD_NAMESPACE}.svc.cluster.local" $stage $stage $stage | quote }}
      csi.cert-manager.io/key-usages: "digital signature,key encipherment,server auth,client auth"
      csi.cert-manager.io/key-algorithm: ECDSA
      csi.cert-manager.io/key-size: "256"
      csi.cert-manager.io/duration: {{ $cm.duration | quote }}
      csi.cert-manager.io/renew-before: {{ $cm.renewBefore | quote }}
      csi.cert-manager.io/certificate-file: tls.crt
      csi.cert-manager.io/privatekey-file: tls.key
      csi.cert-manager.io/ca-file: ca.crt
      csi.cert-manager.io/fs-group: {{ include "specpipe.stageGroup" . | quote }}
{{- else if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "specpipe.tlsSecret" . }}
{{- end }}
{{- end -}}
