{{/* The release's full name: the release name, with the chart's name unless it has it. */}}
{{- define "fleetmedic.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 53 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 53 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "fleetmedic.labels" -}}
app.kubernetes.io/part-of: fleetmedic
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: (dict "root" $ "component" "worker") */}}
{{- define "fleetmedic.selector" -}}
app.kubernetes.io/name: {{ include "fleetmedic.fullname" .root }}-{{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "fleetmedic.serviceAccount" -}}
{{- default (include "fleetmedic.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "fleetmedic.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* the pod-level security context every fleetmedic pod runs with (Pod Security "restricted") */}}
{{- define "fleetmedic.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "fleetmedic.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* the config file and the secrets, for every container */}}
{{- define "fleetmedic.env" -}}
- name: FLEETMEDIC_CONFIG
  value: /etc/fleetmedic/fleetmedic.json
{{- range .Values.secretEnv }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef: {name: {{ .secretName }}, key: {{ .key }}}
{{- end }}
{{- end -}}

{{- define "fleetmedic.configHash" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}
