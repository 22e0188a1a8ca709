"""The RLJob operator: reconciles `RLJob` objects onto KubeRay and reports their state.

Pure modules (`builders`, `observe`, `status`) turn a spec and what is observed in the
cluster into desired objects and the operator's status fields; `reconciler` applies one
decision, `controller` schedules reconciles, `handlers` wires both into kopf. It never
imports torch, ray, megatron or sglang.
"""
