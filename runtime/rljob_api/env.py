"""Environment variables the operator sets on a job's pods and the runtime reads there.

Both sides import these names, so a renamed variable cannot leave one side reading a
variable the other no longer sets.
"""

from __future__ import annotations

# Every container of a job: which RLJob it belongs to (the runtime's status reporter writes
# to it) and which part of the job the container is.
JOB_NAME = "RLJOB_NAME"
JOB_NAMESPACE = "RLJOB_NAMESPACE"
COMPONENT = "RLJOB_COMPONENT"

# The driver: which attempt it is (the operator's restart count when it created the pod),
# reported back with what the attempt resumed from.
RESTARTS = "RLJOB_RESTARTS"

# The driver's weight-sync wiring: engines listen on ENGINE_PORT + their index within the
# pod (the ports the pod declares), the store listens on WEIGHT_SYNC_PORT.
ENGINE_PORT = "RLJOB_ENGINE_PORT"
WEIGHT_SYNC_PORT = "RLJOB_WEIGHT_SYNC_PORT"

# `rljob-weight-sync` run by hand: its engine's URL and the store address.
ENGINE_URL = "RLJOB_ENGINE_URL"
WEIGHT_SYNC_TRAINER = "RLJOB_WEIGHT_SYNC_TRAINER"

# The pod's own name and IP (downward API): a sidecar's name in the weight-sync group and
# the address it advertises; the driver's Ray node address.
POD_NAME = "POD_NAME"
POD_IP = "POD_IP"
# The driver pod's UID (downward API): a resume report names the pod it came from, so the
# operator never takes an earlier pod's report (same attempt number, before a suspension or
# a spec edit) for the running one's.
POD_UID = "POD_UID"

# A worker process's Prometheus endpoint (unset or 0: a free port, which the driver logs).
METRICS_PORT = "RLJOB_METRICS_PORT"

# Ray's token authentication (Ray >= 2.52): every Ray process of the job (head, workers,
# driver) runs with the same mode and token, which the operator keeps in a Secret.
RAY_AUTH_MODE = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"

# The job's peer key: what its own processes prove to each other with. Engines (ours and
# SGLang, through --api-key) refuse a request without `Authorization: Bearer <key>`, and
# every value written to the weight-sync store carries an HMAC under it that readers check
# before they parse anything (`rljob.weightsync.auth`). In pods it is derived from RAY_AUTH_TOKEN,
# which every pod of the job has from the job's Secret; `rljob run` on one machine makes a
# random one and hands it to its Ray workers in this variable.
PEER_KEY = "RLJOB_PEER_KEY"

# The driver pod's status writer: the Unix socket it listens on, in a volume the driver
# container mounts too. Set in both containers; the driver's runtime reports through it
# (the driver container holds no API token), the writer applies what it receives.
STATUS_SOCKET = "RLJOB_STATUS_SOCKET"
