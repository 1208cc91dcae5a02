{{/* Names and labels shared by the templates. */}}

{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.operatorName" -}}
{{- printf "%s-operator" (include "pdserve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces the operator watches, comma-separated ("" in cluster-wide mode). */}}
{{- define "pdserve.watchNamespaces" -}}
{{- if and .Values.operator.clusterWide .Values.operator.watchNamespaces -}}
{{- fail "operator.clusterWide and operator.watchNamespaces exclude each other" -}}
{{- end -}}
{{- if not .Values.operator.clusterWide -}}
{{- .Values.operator.watchNamespaces | default (list .Release.Namespace) | join "," -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: pdserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdserve.operatorSelector" -}}
app.kubernetes.io/name: pdserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's permissions; the same rules go into a ClusterRole or per-namespace Roles. */}}
{{- define "pdserve.operatorRules" -}}
- apiGroups: [pdserve.io]
  resources: [llmservices]
  verbs: [get, list, watch, patch, update]
- apiGroups: [pdserve.io]
  resources: [llmservices/status]
  verbs: [get, patch, update]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: [pdserve.io]
  resources: [llmservices/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
# kopf peering (HA): replicas register in the KopfPeering of each watched namespace.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# Children of an LLMService: watched (list + watch feed the operator's cache), not polled.
- apiGroups: [""]
  resources: [serviceaccounts, configmaps, services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# The autoscaler sets a pool's replicas through the scale subresource (as an HPA does).
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses, networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# An optional Gateway API HTTPRoute (spec.router.httpRoute); applied on change, not watched.
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, create, patch, delete]
# router.mode endpointPicker: an InferencePool (Gateway API Inference Extension); the same.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
# Secrets: create only (the per-service secret, once). Never get, list or watch: the
# operator reads no Secret; pods mount the ones an LLMService names (issue 44 item 12).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get]
# Pods: the autoscaler counts a pool's unschedulable pods (list, by label).
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# The router's Role grants these (its EndpointSlice watch); RBAC lets the operator grant only
# what it holds itself.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
{{- end -}}
