# -*- test-case-name: tests.test_inventory_network -*-
"""
The node's network as the backend's fabric planner reads it (protocol 10.5,
C{inventory.network}): which interface carries the default route, every interface with an
IPv4 address (the I{fabrics}: RoCE, InfiniBand, ethernet or virtual, its RDMA device, PCI
address, speed, MTU, state), and the other interfaces, less per-container ones.

    {default_route_interface, default_route_ip, management_ip,
     fabrics: [{interface, ip, netmask, cidr, speed_gbps, speed_mbps, link_type,
                rdma_device, pci_address, mtu, operstate, has_default_route, is_virtual,
                is_up}],
     all_interfaces: [...], omitted_ephemeral_interfaces}

Facts only: C{has_default_route} is read from the routing table (C{/proc/net/route}), never
guessed; which link is "management" or worth using is the planner's call.

B{Where the facts come from} (Linux; everything relative to an injectable root, so tests read
fixture trees of real sysfs layouts):

 - interfaces: the entries of C{/sys/class/net} (symbolic links into C{/sys/devices});
 - link type: C{type} 32 (C{ARPHRD_INFINIBAND}) is IPoIB; an interface is bound to an RDMA
   device when C{/sys/class/infiniband/<dev>/device/net/<if>} exists (the device's own
   netdevs) or when a GID of the device's ports names it (C{ports/<n>/gid_attrs/ndevs/<i>}:
   RoCE over a bond or a VLAN); the port's C{link_layer} then says C{InfiniBand}
   (infiniband) or C{Ethernet} (roce);
 - virtual: a bridge (C{bridge/}), a tun/tap (C{tun_flags}), a device under
   C{/sys/devices/virtual} that sits on no other interface (no C{lower_*}; bonds and VLANs
   are real links), or a well-known container/VM name (docker, veth, cni, ...);
 - speed: C{speed} in Mb/s; the kernel answers -1 (or EINVAL) when it does not know, which is
   reported as unknown (absent), and for IPoIB the port's C{rate} is used instead;
 - PCI address: the name the C{device} link resolves to (or its parent, for virtio);
 - addresses: C{psutil.net_if_addrs()} (injectable).

Per-container devices (C{veth*}, C{vif*}, C{vnet*}, C{tap*}) come and go with every container:
they are counted in C{omitted_ephemeral_interfaces}, never listed in C{all_interfaces}. Every
read is bounded: at most L{MAX_INTERFACES} interfaces are described (those with an IPv4
address first), at most L{MAX_NAMES} directory entries listed, files read up to
L{MAX_FILE_BYTES}. Unknown values are left out (the inventory never carries a C{null}).

Blocking (file reads, psutil): call L{read_network} in a worker thread.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attrs import field

from llmport_agent.core.values import define

__all__ = [
    "EPHEMERAL_PREFIXES",
    "MAX_INTERFACES",
    "NetworkReader",
    "default_route",
    "read_network",
    "tier1",
]

#: Interfaces described at most (the rest are counted in C{omitted_interfaces}).
MAX_INTERFACES = 256
#: Directory entries listed at most (C{/sys/class/net}, one IB device's links...).
MAX_NAMES = 4096
#: RDMA devices looked at, ports per device, GID entries per port.
MAX_RDMA_DEVICES = 64
MAX_PORTS = 4
MAX_GIDS = 16
#: Bytes read from one sysfs or procfs file.
MAX_FILE_BYTES = 4096
#: Lines of C{/proc/net/route} read.
MAX_ROUTES = 4096
#: Speeds above this (Mb/s, 10 Tb/s) are a driver's "unknown" in disguise.
MAX_SPEED_MBPS = 10_000_000

#: Per-container devices: counted, not listed.
EPHEMERAL_PREFIXES = ("veth", "vif", "vnet", "tap")

#: Container and VM plumbing by name (bonds and VLANs are deliberately not here).
VIRTUAL_PREFIXES = (
    "docker", "br-", "veth", "virbr", "vnet", "vif", "tun", "tap", "cni", "flannel", "kube",
    "cali", "lxc", "lxd", "ovs-", "wg", "zt", "tailscale", "dummy", "ifb", "nomad", "podman",
    "cilium", "vxlan", "genev", "weave", "gre", "sit", "ip6tnl",
)

_ARPHRD_LOOPBACK = 772
_ARPHRD_INFINIBAND = 32
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", re.IGNORECASE)
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec", re.IGNORECASE)
_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")

#: C{(family, address, netmask)} per interface, as psutil reports them.
Addresses = Mapping[str, Sequence[tuple[int, str, str | None]]]


def _psutil_addresses() -> dict[str, list[tuple[int, str, str | None]]]:
    import psutil

    out: dict[str, list[tuple[int, str, str | None]]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[str(name)] = [(int(a.family), str(a.address), a.netmask) for a in addrs]
    return out


def is_ephemeral(name: str) -> bool:
    """Whether C{name} is a per-container device (counted, not listed)."""
    return name.lower().startswith(EPHEMERAL_PREFIXES)


def _ipv4(addrs: Iterable[tuple[int, str, str | None]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for family, address, netmask in addrs:
        if family != socket.AF_INET:
            continue
        entry: dict[str, Any] = {"ip": address, "family": "ipv4"}
        if netmask:
            entry["netmask"] = netmask
            try:
                entry["cidr"] = str(ipaddress.IPv4Network(f"{address}/{netmask}", strict=False))
            except ValueError:
                pass
        out.append(entry)
    return out


def _ipv6(addrs: Iterable[tuple[int, str, str | None]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for family, address, netmask in addrs:
        if family == socket.AF_INET6:
            entry: dict[str, Any] = {"ip": address.split("%", 1)[0], "family": "ipv6"}
            if netmask:
                entry["netmask"] = netmask
            out.append(entry)
    return out


def default_route(text: str) -> tuple[str, str] | None:
    """
    The C{(interface, gateway)} of the best IPv4 default route in C{/proc/net/route} text
    (destination and mask 0, the route up; lowest metric wins), or C{None}.
    """
    best: tuple[int, str, str] | None = None
    for i, line in enumerate(text.splitlines()):
        if i == 0 or i > MAX_ROUTES:
            continue
        parts = line.split()
        if len(parts) < 8:
            continue
        iface, dest, gateway, flags, metric, mask = (
            parts[0], parts[1], parts[2], parts[3], parts[6], parts[7],
        )
        try:
            if int(dest, 16) != 0 or int(mask, 16) != 0 or not int(flags, 16) & 0x1:
                continue
            rank = int(metric)
            gw = socket.inet_ntoa(struct.pack("<L", int(gateway, 16)))
        except (ValueError, struct.error, OSError):
            continue
        if best is None or rank < best[0]:
            best = (rank, iface, gw)
    return None if best is None else (best[1], best[2])


@define
class _Interface:
    name: str
    ipv4: list[dict[str, Any]] = field(factory=list)
    ipv6: list[dict[str, Any]] = field(factory=list)
    facts: dict[str, Any] = field(factory=dict)


class NetworkReader:
    """
    Reads the network facts under C{root} (C{"/"} on a node, a fixture tree in tests).

    @param addresses: returns the addresses per interface (psutil's by default).
    @param max_interfaces: interfaces described at most.
    """

    def __init__(
        self,
        root: str = "/",
        *,
        addresses: Callable[[], Addresses] | None = None,
        max_interfaces: int = MAX_INTERFACES,
    ) -> None:
        self.root = root
        self._addresses = addresses or _psutil_addresses
        self.max_interfaces = max_interfaces
        self._net = os.path.join(root, "sys/class/net")
        self._ib = os.path.join(root, "sys/class/infiniband")
        self._route = os.path.join(root, "proc/net/route")

    # -- small readers

    def _read(self, path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES)
        except OSError:  # missing, or EINVAL (speed of a link that is down)
            return None
        return data.decode("utf-8", "replace").strip()

    def _int(self, path: str, base: int = 10) -> int | None:
        text = self._read(path)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            return None

    def _list(self, path: str) -> list[str]:
        names: list[str] = []
        try:
            with os.scandir(path) as it:
                for entry in it:
                    if len(names) >= MAX_NAMES:
                        break
                    names.append(entry.name)
        except OSError:
            return []
        return sorted(names)

    # -- RDMA

    def _rdma_map(self) -> dict[str, tuple[str, str, str | None]]:
        """
        C{{netdev: (rdma device, link_layer, rate)}} from C{/sys/class/infiniband}; the rate
        only while the port is ACTIVE (a port that is down shows its last or lowest rate).
        """
        found: dict[str, tuple[str, str, str | None]] = {}
        for dev in self._list(self._ib)[:MAX_RDMA_DEVICES]:
            base = os.path.join(self._ib, dev)
            ports = [p for p in self._list(os.path.join(base, "ports")) if p.isdigit()][:MAX_PORTS]
            port = ports[0] if ports else "1"
            layer = self._read(os.path.join(base, "ports", port, "link_layer")) or ""
            state = self._read(os.path.join(base, "ports", port, "state")) or ""
            rate = self._read(os.path.join(base, "ports", port, "rate")) if "ACTIVE" in state else None
            names = self._list(os.path.join(base, "device", "net"))
            for p in ports:
                ndevs = os.path.join(base, "ports", p, "gid_attrs", "ndevs")
                for i in range(MAX_GIDS):
                    name = self._read(os.path.join(ndevs, str(i)))
                    if name:
                        names.append(name)
            for name in names:
                found.setdefault(name, (dev, layer.lower(), rate))
        return found

    # -- one interface

    def _virtual(self, name: str, path: str, resolved: str, flags: int) -> bool:
        if flags & _IFF_LOOPBACK:
            return False
        if os.path.isdir(os.path.join(path, "bridge")) or os.path.exists(os.path.join(path, "tun_flags")):
            return True
        if name.lower().startswith(VIRTUAL_PREFIXES):
            return True
        if "/devices/virtual/" in resolved and not os.path.isdir(os.path.join(path, "bonding")):
            lowers = [n for n in self._list(path) if n.startswith("lower_")]
            return not lowers
        return False

    def _pci_address(self, path: str) -> str | None:
        device = os.path.join(path, "device")
        if not os.path.islink(device):
            return None
        try:
            real = os.path.realpath(device)
        except OSError:
            return None
        for candidate in (os.path.basename(real), os.path.basename(os.path.dirname(real))):
            if _PCI_ADDRESS.match(candidate):
                return candidate.lower()
        return None

    def _describe(
        self, iface: _Interface, rdma: Mapping[str, tuple[str, str, str | None]],
        default_if: str | None,
    ) -> None:
        name = iface.name
        path = os.path.join(self._net, name)
        facts = iface.facts
        if not os.path.exists(path):  # not Linux, or not in this root: addresses only
            facts.update(link_type="loopback" if name == "lo" else "ethernet", operstate="unknown")
        else:
            try:
                resolved = os.path.realpath(path)
            except OSError:
                resolved = path
            arphrd = self._int(os.path.join(path, "type"))
            flags = self._int(os.path.join(path, "flags"), 16) or 0
            operstate = (self._read(os.path.join(path, "operstate")) or "unknown").lower()
            facts["operstate"] = operstate
            mtu = self._int(os.path.join(path, "mtu"))
            if mtu is not None and mtu > 0:
                facts["mtu"] = mtu
            mac = self._read(os.path.join(path, "address"))
            if mac and mac.strip("0:") and len(mac) <= 64:
                facts["mac"] = mac.lower()
            speed = self._int(os.path.join(path, "speed"))
            if speed is not None and 0 < speed <= MAX_SPEED_MBPS:
                facts["speed_mbps"] = speed
            pci = self._pci_address(path)
            if pci:
                facts["pci_address"] = pci
            bound = rdma.get(name)
            if arphrd == _ARPHRD_LOOPBACK or flags & _IFF_LOOPBACK or name == "lo":
                link_type = "loopback"
            elif bound is not None:
                device, layer, rate = bound
                facts["rdma_device"] = device
                if layer == "infiniband" or arphrd == _ARPHRD_INFINIBAND:
                    link_type = "infiniband"
                else:
                    link_type = "roce"
                if "speed_mbps" not in facts and rate:
                    m = _RATE.match(rate)
                    if m and 0 < float(m.group(1)) * 1000 <= MAX_SPEED_MBPS:
                        facts["speed_mbps"] = int(float(m.group(1)) * 1000)
            elif arphrd == _ARPHRD_INFINIBAND:
                link_type = "infiniband"  # IPoIB whose HCA this root does not show
            elif self._virtual(name, path, resolved, flags):
                link_type = "virtual"
            else:
                link_type = "ethernet"
            facts["link_type"] = link_type
            if operstate == "up":
                facts["is_up"] = True
            else:
                # Loopback, tun and some drivers say "unknown": administratively up with a
                # carrier is up then (reading carrier fails while the link is down).
                facts["is_up"] = bool(
                    operstate == "unknown" and flags & _IFF_UP
                    and self._int(os.path.join(path, "carrier")) == 1
                )
            if os.path.isdir(os.path.join(path, "bonding")):
                slaves = (self._read(os.path.join(path, "bonding", "slaves")) or "").split()
                facts["bond_slaves"] = [s for s in slaves if _NAME.match(s)][:32]
        facts.setdefault("is_up", facts.get("operstate") == "up")
        if "speed_mbps" in facts:
            facts["speed_gbps"] = round(facts["speed_mbps"] / 1000.0, 2)
        facts["is_virtual"] = facts["link_type"] == "virtual"
        facts["has_default_route"] = default_if is not None and name == default_if

    # -- the whole

    def read(self) -> dict[str, Any]:
        """The C{network} object (blocking)."""
        try:
            addresses = dict(self._addresses())
        except Exception:
            addresses = {}
        names = [n for n in self._list(self._net) if _NAME.match(n)]
        if not names:
            names = sorted(n for n in addresses if _NAME.match(n))[:MAX_NAMES]
        route_text = self._read_route()
        route = default_route(route_text) if route_text else None
        default_if = route[0] if route else None
        ifaces = [_Interface(n, _ipv4(addresses.get(n, ())), _ipv6(addresses.get(n, ()))) for n in names]
        ephemeral = [i for i in ifaces if is_ephemeral(i.name)]
        # Described: those with an IPv4 address (fabric candidates) first, then the rest;
        # per-container devices only when they hold an IPv4 address.
        wanted = [i for i in ifaces if i.ipv4 or i.name == default_if]
        wanted += [i for i in ifaces if not (i.ipv4 or i.name == default_if) and not is_ephemeral(i.name)]
        described = wanted[: self.max_interfaces]
        rdma = self._rdma_map() if described else {}
        for iface in described:
            self._describe(iface, rdma, default_if)
        described.sort(key=lambda i: i.name)

        network: dict[str, Any] = {"fabrics": [], "all_interfaces": []}
        for iface in described:
            facts = iface.facts
            if iface.name == default_if:
                network["default_route_interface"] = iface.name
                if iface.ipv4:
                    network["default_route_ip"] = iface.ipv4[0]["ip"]
                    network["management_ip"] = iface.ipv4[0]["ip"]
            if iface.ipv4 and facts["link_type"] != "loopback":
                first = iface.ipv4[0]
                fabric: dict[str, Any] = {"interface": iface.name, "ip": first["ip"]}
                for key in ("netmask", "cidr"):
                    if key in first:
                        fabric[key] = first[key]
                for key in ("speed_gbps", "speed_mbps", "link_type", "rdma_device", "pci_address",
                            "mtu", "operstate", "has_default_route", "is_virtual", "is_up"):
                    if key in facts:
                        fabric[key] = facts[key]
                network["fabrics"].append(fabric)
            if not is_ephemeral(iface.name):
                network["all_interfaces"].append(
                    {"name": iface.name, "ips": iface.ipv4 + iface.ipv6, **facts}
                )
        if route is not None:
            network["default_gateway"] = route[1]
        network["omitted_ephemeral_interfaces"] = len(ephemeral)
        network["omitted_interfaces"] = len(wanted) - len(described)
        return network

    def _read_route(self) -> str | None:
        try:
            with open(self._route, "rb") as f:
                data = f.read(MAX_FILE_BYTES * 64)
        except OSError:
            return None
        return data.decode("ascii", "replace")


def read_network(root: str = "/", addresses: Callable[[], Addresses] | None = None) -> dict[str, Any]:
    """L{NetworkReader}C{(root).read()}: blocking, for a worker thread."""
    return NetworkReader(root, addresses=addresses).read()


def tier1(network: Mapping[str, Any]) -> dict[str, Any]:
    """The part the backend copies into the node's capabilities: all but C{all_interfaces}."""
    return {k: v for k, v in network.items() if k != "all_interfaces"}
