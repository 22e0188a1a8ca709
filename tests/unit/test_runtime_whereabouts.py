"""Pure parts of the cluster path of the runtime: the `ray start` of the driver's node, the
placement table and its check, and which attempt a run is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob.cluster.cluster import attempt_number, expected_group
from rljob.cluster.ray_node import node_ip, parse_address, ray_start_command, redacted
from rljob.cluster.whereabouts import Placed, dead_hosts, json_line, node_groups, parse_line, table

pytestmark = pytest.mark.unit


def test_the_driver_node_takes_no_work_but_what_asks_for_it() -> None:
    cmd = ray_start_command("rl-head-svc.ns.svc:6379", Path("/tmp/rljob-ray-x"), "10.1.2.3")
    assert cmd[1:4] == ["-m", "ray.scripts.scripts", "start"]
    assert "--block" not in cmd  # it returns once the node runs; the driver goes on
    assert {"--address=rl-head-svc.ns.svc:6379", "--num-cpus=0", "--num-gpus=0",
            "--node-ip-address=10.1.2.3", "--temp-dir=/tmp/rljob-ray-x"} <= set(cmd)
    (resources,) = [a for a in cmd if a.startswith("--resources=")]
    assert json.loads(resources.removeprefix("--resources=")) == {"rljob_driver": 1}
    assert not any(a.startswith("--node-ip-address") for a in ray_start_command(
        "h:1", Path("/t"), None))


def test_join_address_and_pod_ip() -> None:
    assert parse_address("rl-head-svc.ns.svc:6379") == ("rl-head-svc.ns.svc", 6379)
    for bad in ("rl-head-svc", ":6379", "h:0", "h:port", "h:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)
    assert node_ip({"POD_IP": "10.0.0.7"}) == "10.0.0.7"
    assert node_ip({"POD_IP": ""}) is None and node_ip({}) is None


def test_attempt_is_the_operators_restart_count() -> None:
    assert attempt_number({"RLJOB_RESTARTS": "3"}) == 3
    assert attempt_number({}) == 0 and attempt_number({"RLJOB_RESTARTS": "x"}) == 0


NODES = [
    {"NodeID": "h", "Alive": True, "Resources": {"node:__internal_head__": 1.0, "CPU": 0.0}},
    {"NodeID": "t", "Alive": True, "Resources": {"CPU": 8.0, "rljob_trainer": 8.0}},
    {"NodeID": "r", "Alive": True, "Resources": {"GPU": 1.0, "rljob_rollout": 1.0}},
    {"NodeID": "d", "Alive": True, "Resources": {"rljob_driver": 1.0}},
    {"NodeID": "old", "Alive": False, "Resources": {"rljob_driver": 1.0}},
    {"NodeID": "x", "Alive": True, "Resources": {"CPU": 2.0}},
]


def test_nodes_are_told_apart_by_the_operators_resources() -> None:
    assert node_groups(NODES) == {"h": "head", "t": "trainer", "r": "rollout", "d": "driver",
                                  "x": ""}


@pytest.mark.parametrize(("role", "colocated", "group"), [
    ("trainer", False, "trainer"), ("engine", False, "rollout"),
    ("weight-sync-sidecar", False, "rollout"), ("trainer", True, "colocated"),
    ("engine", True, "colocated"), ("rollout-worker", False, "driver"),
    ("weight-sync-store", True, "head")])
def test_where_each_actor_belongs(role: str, colocated: bool, group: str) -> None:
    assert expected_group(role, colocated) == group


def test_placement_table_and_line_flag_a_misplaced_actor() -> None:
    rows = [Placed("trainer", 0, "t" * 56, "rl-trainer-worker-abc", "trainer", "trainer"),
            Placed("rollout-worker", 0, "h" * 56, "rl-head-xyz", "head", "driver"),
            Placed("engine", 0, "x" * 56, "laptop", "", None)]
    text = table(rows)
    assert "rl-trainer-worker-abc" in text and "tttttttttttt " in text
    lines = text.splitlines()
    assert lines[2].split()[-1] == "yes" and lines[3].split()[-1] == "NO"
    line = json_line(rows)
    assert line.startswith("placement: {") and "\n" not in line
    parsed = parse_line(line)
    assert parsed is not None and parsed["ok"] is False
    assert [(a["role"], a["host"], a["group"], a["expected"], a["ok"])
            for a in parsed["actors"]] == [
        ("trainer", "rl-trainer-worker-abc", "trainer", "trainer", True),
        ("rollout-worker", "rl-head-xyz", "head", "driver", False),
        ("engine", "laptop", "", None, True)]
    assert parse_line("ray: joined ...") is None


def test_dead_hosts_are_this_attempts_nodes_that_ray_counts_dead() -> None:
    placed = [Placed("trainer", 0, "n-t", "rl-trainer-x", "trainer", "trainer"),
              Placed("engine", 0, "n-r", "rl-rollout-y", "rollout", "rollout")]
    nodes = [
        {"NodeID": "n-t", "Alive": False, "DeathReasonMessage": "health check failed"},
        {"NodeID": "n-r", "Alive": True},
        {"NodeID": "n-old", "Alive": False, "DeathReasonMessage": "an earlier attempt's"},
    ]
    assert dead_hosts(placed, nodes) == {"rl-trainer-x": "health check failed"}
    assert dead_hosts(placed, [{"NodeID": "n-r", "Alive": False}]) == {
        "rl-rollout-y": "Ray marked its node dead"}
    assert dead_hosts(placed, nodes[1:]) == {}


def test_ray_start_output_loses_the_token_before_it_can_reach_the_status(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f00d" * 16)
    text = redacted(f"ray start --address=h:6379 ... RAY_AUTH_TOKEN={'f00d' * 16} failed")
    assert "f00d" not in text and "RAY_AUTH_TOKEN=<RAY_AUTH_TOKEN> failed" in text
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    assert redacted("as it was") == "as it was"
