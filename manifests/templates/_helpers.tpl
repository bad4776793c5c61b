{{- define "meshfn.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "meshfn.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "meshfn.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "meshfn.serviceAccount" -}}
{{- default (include "meshfn.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "meshfn.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "meshfn.leaseName" -}}
{{- printf "%s-leader" (include "meshfn.fullname" .) -}}
{{- end -}}

{{- /* The audit components' pods: labels apart from the operator's (its selector must not
match them). */ -}}
{{- define "meshfn.auditSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-audit
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* "true" when the chart deploys the trial PostgreSQL, else empty. */ -}}
{{- define "meshfn.postgres" -}}
{{- if and .Values.auditStore.postgresql.trial.enabled (not .Values.auditStore.postgresql.existingSecret) -}}
true
{{- end -}}
{{- end -}}

{{- define "meshfn.storeSecret" -}}
{{- default (printf "%s-audit-store" (include "meshfn.fullname" .)) .Values.auditStore.postgresql.existingSecret -}}
{{- end -}}

{{- /* The audit store's database roles, one per component (meshfn audit init grants them). */ -}}
{{- define "meshfn.auditRoles" -}}
collector: meshfn_audit_collector
signer: meshfn_audit_signer
reader: meshfn_audit_reader
auditor: meshfn_audit_auditor
{{- end -}}

{{- define "meshfn.signerAddress" -}}
{{- printf "tcp:%s-audit-signer.%s.svc:%d" (include "meshfn.fullname" .) .Release.Namespace (int .Values.auditSigner.port) -}}
{{- end -}}
