"""A real Kubernetes control plane on loopback for tests: etcd + kube-apiserver, and on
demand kube-scheduler, kube-controller-manager, kwok with fake GPU nodes, the KubeRay
operator with its CRDs, and a volume provisioner behind a default StorageClass.

Binaries come from `hack/k8s-bins` (pinned Go modules, cached, or `$RLJOB_K8S_BIN`).
Everything runs as child processes on random free ports with a private temp dir; TLS is a
throwaway CA, and the admin authenticates with a static token, which both kubectl and the
Python clients accept. `stop()` kills every process even after a failed test.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.polling import wait_for

REPO = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "rljob-test-admin-token"
# A second admin whose every request the API server writes to its audit log (and only
# that user's): a test runs a client as this user to count exactly what the client asks.
AUDITED_USER = "audited-admin"
AUDITED_TOKEN = "rljob-test-audited-token"
GPU = "nvidia.com/gpu"


def k8s_bin_dir() -> Path:
    """Run hack/k8s-bins (builds once, then answers from cache) and return its directory."""
    proc = subprocess.run(
        [str(REPO / "hack" / "k8s-bins")], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hack/k8s-bins failed:\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, an API-server serving cert for 127.0.0.1/localhost, and a service-account key."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=rljob-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=d,
    )
    (d / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        "apiserver.key",
        "-out",
        "apiserver.csr",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.cnf",
        "-out",
        "apiserver.crt",
        cwd=d,
    )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


@dataclass
class ControlPlane:
    """Processes of one test control plane; start pieces with the `start_*` methods."""

    bins: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rljob-k8s-")))
    processes: dict[str, Process] = field(default_factory=dict)
    api_port: int = 0
    api_args: list[str] = field(default_factory=list)

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def audited_kubeconfig(self) -> Path:
        """A kubeconfig of the audited admin (AUDITED_USER)."""
        return self.root / "kubeconfig-audited"

    @property
    def audit_log(self) -> Path:
        return self.root / "audit.log"

    def audit_policy(self) -> str:
        """The API server's audit policy: the audited admin's requests, at Metadata level,
        one event per request (a watch when its response starts, any other when it ends)."""
        return (
            "apiVersion: audit.k8s.io/v1\nkind: Policy\n"
            "omitStages: [RequestReceived]\nrules:\n"
            f"- level: Metadata\n  users: [{AUDITED_USER}]\n"
            "- level: None\n"
        )

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:  # a restarted component appends to its log
            popen = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        proc = Process(name, popen, log)
        self.processes[name] = proc
        return proc

    def _alive(self, proc: Process) -> bool:
        """True while `proc` runs; a component that died fails the wait with its log."""
        if proc.popen.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with {proc.popen.returncode}; log tail:\n{proc.tail()}"
            )
        return True

    def stop_process(self, name: str) -> None:
        proc = self.processes.pop(name, None)
        if proc is None or proc.popen.poll() is not None:
            return
        proc.popen.terminate()
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(timeout=10)

    def stop(self) -> None:
        """Stop everything, newest first, and remove the temp dir."""
        for name in reversed(list(self.processes)):
            self.stop_process(name)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- core ------------------------------------------------------------------------------

    def start_core(self, timeout: float = 90) -> None:
        make_pki(self.pki)
        etcd_port, peer_port = free_port(), free_port()
        etcd = self._spawn(
            "etcd",
            [
                str(self.bins / "etcd"),
                "--data-dir",
                str(self.root / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        (self.root / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n'
            f'{AUDITED_TOKEN},{AUDITED_USER},audited-uid,"system:masters"\n')
        policy = self.root / "audit-policy.yaml"
        policy.write_text(self.audit_policy())
        self.api_port = free_port()
        p = self.pki
        self.api_args = [
            str(self.bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--secure-port={self.api_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--token-auth-file={self.root / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            f"--cert-dir={self.root / 'apiserver-certs'}",
            "--profiling=false",
            "--enable-priority-and-fairness=false",
            "--endpoint-reconciler-type=none",
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=0",
        ]
        self._write_kubeconfig()
        self.start_apiserver(timeout, etcd)

    def start_apiserver(self, timeout: float = 90, etcd: Process | None = None) -> None:
        """(Re)start kube-apiserver with the arguments `start_core` chose: same port, same
        certificates and etcd, so clients and their kubeconfig keep working."""
        etcd = etcd or self.processes["etcd"]
        api = self._spawn("kube-apiserver", self.api_args)

        def ready() -> bool:
            self._alive(etcd)
            self._alive(api)
            return self._get("/readyz") == "ok"

        wait_for(
            ready,
            timeout=timeout,
            interval=0.3,
            what="kube-apiserver /readyz",
            describe=lambda: api.tail(),
        )

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver, as an outage of the control plane; etcd keeps the objects
        and `start_apiserver` brings it back. Connections are refused until then."""
        self.stop_process("kube-apiserver")

    def _write_kubeconfig(self) -> None:
        ca = base64.b64encode((self.pki / "ca.crt").read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "rljob-test",
            "clusters": [
                {
                    "name": "rljob-test",
                    "cluster": {"server": self.server, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
            "contexts": [
                {
                    "name": "rljob-test",
                    "context": {"cluster": "rljob-test", "user": "admin", "namespace": "default"},
                }
            ],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        config["users"] = [{"name": "admin", "user": {"token": AUDITED_TOKEN}}]
        self.audited_kubeconfig.write_text(yaml.safe_dump(config))

    def _get(self, path: str) -> str:
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        req = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
            return str(resp.read().decode())

    # -- kubectl ---------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, token: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        if token is not None:
            cmd.insert(2, f"--token={token}")
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]] | str, *extra: str) -> str:
        text = (
            obj
            if isinstance(obj, str)
            else yaml.safe_dump_all(obj if isinstance(obj, list) else [obj])
        )
        return self.kubectl("apply", "-f", "-", *extra, input=text).stdout

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def install_crds(self, path: Path, timeout: float = 60) -> None:
        """Apply CRD files (server-side: big schemas exceed the last-applied annotation)."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        docs = [path] if path.is_file() else sorted(path.glob("*.yaml"))
        names = [
            crd["metadata"]["name"]
            for doc in docs
            for crd in yaml.safe_load_all(doc.read_text())
            if crd
        ]
        for name in names:
            wait_for(
                functools.partial(self._established, name),
                timeout=timeout,
                what=f"CRD {name} Established",
            )

    def _established(self, crd: str) -> bool:
        wait = self.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd}", "--timeout=5s", check=False
        )
        return wait.returncode == 0

    # -- optional components ---------------------------------------------------------------

    def _healthy(self, proc: Process, port: int) -> bool:
        """A component's own /healthz (self-signed serving cert, so unverified)."""
        import ssl

        self._alive(proc)
        ctx = ssl._create_unverified_context()
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=5
        ) as resp:
            return bool(resp.read() == b"ok")

    def _component_args(self, name: str, port: int) -> list[str]:
        """What kube-scheduler and kube-controller-manager share: the admin kubeconfig for
        everything, no leader election, and /healthz on a private loopback port."""
        return [
            str(self.bins / name),
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            f"--secure-port={port}",
            "--bind-address=127.0.0.1",
        ]

    def start_scheduler(self) -> None:
        port = free_port()
        proc = self._spawn("kube-scheduler", self._component_args("kube-scheduler", port))
        wait_for(
            lambda: self._healthy(proc, port),
            timeout=60,
            what="kube-scheduler /healthz",
            describe=proc.tail,
        )

    def start_controller_manager(self, *extra: str) -> None:
        """kube-controller-manager: garbage collection, service accounts, node lifecycle, and
        the persistentvolume-binder that binds claims to the provisioner's volumes."""
        port = free_port()
        proc = self._spawn(
            "kube-controller-manager",
            [
                *self._component_args("kube-controller-manager", port),
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                "--use-service-account-credentials=false",
                "--controllers=*,-bootstrapsigner,-tokencleaner,-nodeipam,-service-lb-controller,"
                "-route,-cloud-node-lifecycle,-attachdetach",
                *extra,
            ],
        )
        wait_for(
            lambda: (
                self._healthy(proc, port)
                and self.kubectl(
                    "get", "serviceaccount", "default", "-n", "default", check=False
                ).returncode
                == 0
            ),
            timeout=60,
            what="kube-controller-manager to create the default ServiceAccount",
            describe=proc.tail,
        )

    def start_kwok(
        self,
        nodes: int = 2,
        gpus_per_node: int = 8,
        prefix: str = "gpu-node",
        lease_seconds: int = 40,
    ) -> None:
        """kwok managing `nodes` fake nodes that advertise `gpus_per_node` nvidia.com/gpu.

        kwok renews each node's Lease every `lease_seconds` / 4; the controller-manager's
        node-monitor grace period must not be shorter than `lease_seconds`."""
        proc = self._spawn(
            "kwok",
            [
                str(self.bins / "kwok"),
                f"--kubeconfig={self.kubeconfig}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--manage-single-node=",
                "--cidr=10.244.0.1/16",
                "--node-ip=10.0.0.2",
                f"--server-address=127.0.0.1:{free_port()}",
                # Heartbeat through Leases: kwok's status refresh alone (about once a
                # minute) is slower than the node controller's 50 s grace period, so nodes
                # would flap NotReady every minute and jobs be restarted as NodeLost.
                f"--node-lease-duration-seconds={lease_seconds}",
            ],
        )
        self.add_fake_nodes(nodes, gpus_per_node, prefix)
        wait_for(
            lambda: self._alive(proc) and self._nodes_ready(prefix, nodes),
            timeout=60,
            what=f"{nodes} kwok nodes Ready",
            describe=proc.tail,
        )

    def add_fake_nodes(
        self, count: int, gpus: int, prefix: str = "gpu-node", labels: dict[str, str] | None = None
    ) -> list[str]:
        names = [f"{prefix}-{i}" for i in range(count)]
        self.apply([fake_node(n, gpus, labels) for n in names])
        return names

    def _nodes_ready(self, prefix: str, count: int) -> bool:
        items = self.get_json("nodes")["items"]
        ready = [
            n
            for n in items
            if n["metadata"]["name"].startswith(prefix)
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        ]
        return len(ready) >= count

    def start_volume_provisioner(self) -> None:
        """A default StorageClass and its provisioner (`tests.volume_provisioner`), so claims
        such as an RLJob's `<job>-checkpoints` are bound and their pods get scheduled."""
        proc = self._spawn(
            "volume-provisioner",
            [sys.executable, "-m", "tests.volume_provisioner",
             f"--kubeconfig={self.kubeconfig}"],
            env={"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
        )
        wait_for(
            lambda: self._alive(proc) and "provisioning" in proc.log.read_text(errors="replace"),
            timeout=60,
            what="the volume provisioner to start",
            describe=proc.tail,
        )

    def start_kuberay(self, reconcile_concurrency: int = 1) -> None:
        """The KubeRay operator (out of cluster) with the CRDs of the same Go module, with
        `reconcile_concurrency` reconcile workers (KubeRay's default: one)."""
        self.install_crds(self.bins / "kuberay-crds")
        proc = self._spawn(
            "kuberay-operator",
            [
                str(self.bins / "kuberay-operator"),
                f"--kubeconfig={self.kubeconfig}",
                "--enable-leader-election=false",
                f"--reconcile-concurrency={reconcile_concurrency}",
                f"--metrics-addr=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{free_port()}",
            ],
            env={"KUBECONFIG": str(self.kubeconfig), "ENABLE_WEBHOOKS": "false"},
        )
        wait_for(
            lambda: (
                self._alive(proc)
                and "Starting workers" in proc.log.read_text(errors="replace")
            ),
            timeout=60,
            what="KubeRay operator to start its workers",
            describe=proc.tail,
        )

    def start_kueue(self) -> None:
        """Kueue's controller manager (out of cluster) with its CRDs, managing RLJobs as an
        external framework, as a cluster would run it for the operator's `--kueue`. No
        webhook configuration is installed (nothing calls its webhooks), so its serving and
        metrics certificates only have to exist: throwaway ones, the metrics pair at the
        path Kueue reads it from without a setting."""
        self.install_crds(self.bins / "kueue-crds", timeout=120)
        self.kubectl("create", "namespace", "kueue-system", check=False)
        certs = self.root / "kueue-certs"
        certs.mkdir(exist_ok=True)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                 "-subj", "/CN=kueue", "-keyout", "tls.key", "-out", "tls.crt", cwd=certs)
        metrics = Path("/etc/kueue/metrics/certs")
        if not (metrics / "tls.crt").exists():
            metrics.mkdir(parents=True, exist_ok=True)
            shutil.copy(certs / "tls.crt", metrics / "tls.crt")
            shutil.copy(certs / "tls.key", metrics / "tls.key")
        config = self.root / "kueue-config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "leaderElection": {"leaderElect": False},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": "0"},
            "webhook": {"port": free_port(), "host": "127.0.0.1", "certDir": str(certs)},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["batch/job"],
                             "externalFrameworks": ["RLJob.v1alpha1.rljob.io"]},
            "featureGates": {"VisibilityOnDemand": False},
        }))
        proc = self._spawn("kueue", [str(self.bins / "kueue"), f"--config={config}",
                                     f"--kubeconfig={self.kubeconfig}"],
                           env={"KUBECONFIG": str(self.kubeconfig)})
        wait_for(
            lambda: (self._alive(proc)
                     and "Starting workers" in proc.log.read_text(errors="replace")),
            timeout=90, what="Kueue to start its workers", describe=proc.tail)


def fake_node(name: str, gpus: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node object kwok will keep Ready, advertising `gpus` nvidia.com/gpu, and CPU,
    memory and pod room in proportion past 8 GPUs (64 cores, 512 GiB, 110 pods per 8), so
    a large simulated node holds as many pods as its GPUs take."""
    scale = max(gpus, 8) // 8
    capacity = {"cpu": str(64 * scale), "memory": f"{512 * scale}Gi",
                "pods": str(110 * scale), GPU: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **(labels or {}),
            },
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


@contextlib.contextmanager
def temporary_namespace(control_plane: ControlPlane, name: str) -> Iterator[str]:
    """Namespace `name`, deleted (without waiting) when the block ends."""
    control_plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)
