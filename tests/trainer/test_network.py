"""Where a node talks: loopback alone, the route to the rendezvous host with others; the
user's own settings win."""

from __future__ import annotations

import subprocess
import sys

from fixtures.netns import nodes
from fixtures.runs import REPO
from meshscope.config import RunConfig
from meshscope.launcher import hosts_rendezvous, route, torchrun_command, worker_environment
from meshscope.trainer.network import Route, network_environment, node_route, route_to


def test_one_node_talks_on_loopback():
    assert node_route(False, "10.0.0.1:29400") == Route("lo", "127.0.0.1")
    assert route_to("127.0.0.1") == Route("lo", "127.0.0.1")
    assert network_environment(Route("lo", "127.0.0.1"), {}) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


def test_what_the_user_set_wins(monkeypatch):
    user = {"GLOO_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": "8", "NCCL_SOCKET_IFNAME": "ib0"}
    assert network_environment(Route("eth0", "10.0.0.2"), user) == {}
    for key, value in user.items():
        monkeypatch.setenv(key, value)
    env = worker_environment(RunConfig(device="cpu"))
    assert {k: env[k] for k in user} == user


def _route_seen_from(node, host: str) -> list[str]:
    """route_to(host) as `node` sees it: [interface, address]."""
    probe = f"from meshscope.trainer.network import route_to as r; print(*r({host!r}).__dict__.values())"
    out = subprocess.run(
        node.command(sys.executable, "-c", probe), capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_node_among_others_uses_the_route_to_the_rendezvous_host():
    with nodes(2) as (first, second):
        assert _route_seen_from(second, first.address) == [second.veth, second.address]


def test_the_node_that_hosts_the_rendezvous_uses_the_interface_that_holds_its_address():
    """Its route to its own address is `local ... dev lo`: binding lo would advertise 127.0.0.1,
    which the other nodes cannot dial."""
    with nodes(2) as (first, _):
        assert _route_seen_from(first, first.address) == [first.veth, first.address]


def test_several_agents_advertise_the_address_on_their_route():
    cfg = RunConfig(device="cpu", run_id="j", elastic={"nnodes": "2", "rdzv_endpoint": "127.0.0.1:29400"})
    assert route(cfg) == Route("lo", "127.0.0.1")
    command = torchrun_command(cfg, warm=False)
    assert "--local-addr=127.0.0.1" in command
    # on loopback torchrun's own guess (with its fallback for a second local agent) stands
    assert not hosts_rendezvous(cfg) and not any("is_host" in c for c in command)
