"""Where this node talks to the others: the interface and address on the route to the
rendezvous host.

One node: loopback, always (nothing leaves the machine). Several nodes: gloo — the job's
group on CPU, and meshscope's control plane on every backend — must bind the interface that
reaches the other nodes, and the agent must advertise an address they can dial (torchrun's
`--local-addr`; a hostname that resolves to loopback would send peers to their own machine).
Both come from the kernel's route to the rendezvous host. Whatever the user set in the
environment (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`, `HCCL_SOCKET_IFNAME`,
`OMP_NUM_THREADS`) wins over what meshscope would choose.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
from dataclasses import dataclass

LOOPBACK = "lo"
# What the user may have set and meshscope must not override.
USER_WINS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Route:
    """The interface and source address this node reaches `host` through."""

    interface: str
    address: str


def route_to(host: str, port: int = 29400) -> Route:
    """The route to `host` (its interface and our source address on it), from the kernel.

    `ip route get` names both; without iproute2 a UDP socket "connected" to the host gives the
    source address (no packet is sent) and the interface is the one holding that address.
    On the node that hosts the rendezvous the route to its own address is local (`dev lo`):
    the other nodes reach it on the interface that holds the address, which is the one used."""
    address = socket.gethostbyname(host)
    try:
        out = subprocess.run(
            ["ip", "-o", "route", "get", address], capture_output=True, text=True, timeout=5, check=True
        ).stdout.split()
        return _reachable(Route(out[out.index("dev") + 1], out[out.index("src") + 1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        source = s.getsockname()[0]
    return _reachable(Route(_interface_with(source), source))


def _reachable(route: Route) -> Route:
    """A route through loopback to a non-loopback address (this node's own) becomes the
    interface that holds the address: what the other nodes dial."""
    if route.interface != LOOPBACK or route.address.startswith("127."):
        return route
    return Route(_interface_with(route.address) or route.interface, route.address)


def _interface_with(address: str) -> str:
    """The interface that holds `address` (loopback for 127.x; "" when unknown)."""
    if address.startswith("127."):
        return LOOPBACK
    held = _holder(address)
    return held[0] if held else ""


def _holder(address: str) -> tuple[str, str] | None:
    """(interface, address/prefix) of the interface that holds `address`, from the kernel."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == address:
            return parts[1], parts[3]
    return None


def rendezvous_host(endpoint: str) -> str:
    """The host of a `host:port` rendezvous endpoint."""
    return endpoint.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"


def node_route(multi_node: bool, rdzv_endpoint: str) -> Route:
    """Loopback for one node; the route to the rendezvous host for several."""
    if not multi_node:
        return Route(LOOPBACK, "127.0.0.1")
    return route_to(rendezvous_host(rdzv_endpoint or "127.0.0.1:29400"))


def network_environment(route: Route, user: dict[str, str]) -> dict[str, str]:
    """What the workers need to talk on `route`, less what the user already set."""
    wanted = {"GLOO_SOCKET_IFNAME": route.interface, "OMP_NUM_THREADS": "1"}
    return {k: v for k, v in wanted.items() if v and k not in user}


def node_network() -> tuple[str, str]:
    """This node's address on its default route and that interface's network (CIDR): what a
    server the other nodes use listens on and admits. ("127.0.0.1", "") without such a route."""
    try:
        out = subprocess.run(
            ["ip", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.split()  # the kernel's answer: no packet is sent
        address = out[out.index("src") + 1]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return "127.0.0.1", ""
    held = _holder(address)
    return address, str(ipaddress.ip_interface(held[1]).network) if held else f"{address}/32"
