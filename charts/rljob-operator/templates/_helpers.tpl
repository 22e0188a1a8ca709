{{/* Names are cut at 63 characters: the limit of a label value and of a DNS label. */}}
{{- define "rljob-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rljob-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rljob-operator.labels" -}}
{{ include "rljob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rljob
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "rljob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rljob-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace whose RLJobs the operator reconciles in namespace scope. */}}
{{- define "rljob-operator.watchNamespace" -}}
{{- default .Release.Namespace .Values.watchNamespace -}}
{{- end -}}

{{- define "rljob-operator.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- end -}}

{{/*
Namespaced rights of the operator: exactly the calls it makes (rljob_operator.kube and kopf's
watches). The per-job ServiceAccount/Role/RoleBinding it creates may grant only rights it
holds itself (RBAC refuses anything else), so no `escalate` or `bind` is needed. The driver
is a bare Pod; failed or stranded compute pods are deleted for recovery. `get` on what it
creates: when a child's name is taken, it reads the owner references to adopt only the
job's own object. RayClusters are patched when the spec of a running job changes; pods and
RayClusters also to put back the job's labels where someone removed them.
*/}}
{{- define "rljob-operator.namespacedRules" -}}
- apiGroups: ["rljob.io"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "create"]
{{- /* The job's Ray token: created once, never read back or rewritten (its name carries
the job's UID, so one that exists is the job's own). */}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
{{- /* Each job's NetworkPolicy: only the job's own pods reach its pods (engines, the
weight-sync store, Ray). `get`: to tell, after a conflict, whether one is the job's own. */}}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.kueue.enabled }}
{{- /* Kueue: each queued job's Workload, written as Kueue's job integrations write theirs;
the finalizers subresource of RLJobs because a Workload is owned by its job with
blockOwnerDeletion. */}}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
{{- end }}
{{- end -}}

{{/* Nodes are cluster-scoped: listing them (lost-node detection) needs a ClusterRole. */}}
{{- define "rljob-operator.nodeRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list"]
{{- if .Values.kueue.enabled }}
{{- /* Cluster-scoped too: the admitted flavors' node labels and tolerations, and the
priority a job's Workload carries. */}}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors", "workloadpriorityclasses"]
  verbs: ["get"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- end }}
{{- end -}}

{{/* Cluster-wide kopf discovers resources by watching CRDs (scanning is off per namespace). */}}
{{- define "rljob-operator.discoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}

{{/* Command-line arguments of `rljob-operator` (rljob_operator.config). */}}
{{- define "rljob-operator.args" -}}
{{- if eq .Values.rbac.scope "namespace" }}
- --namespace={{ include "rljob-operator.watchNamespace" . }}
{{- end }}
- --metrics-port={{ .Values.metrics.port }}
- --liveness=http://0.0.0.0:{{ .Values.health.port }}/healthz
- --interval={{ .Values.operator.interval }}
- --workers={{ .Values.operator.workers }}
{{- if .Values.operator.verbose }}
- --verbose
{{- end }}
{{- if .Values.kueue.enabled }}
- --kueue
{{- end }}
{{- with .Values.operator.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end -}}
