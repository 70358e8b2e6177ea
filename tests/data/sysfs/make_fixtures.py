"""
Writes the sysfs/procfs fixture trees under this directory (run it again after a change:
C{python3 tests/data/sysfs/make_fixtures.py}; the trees are committed).

Each tree copies the layout of a real kernel (5.x/6.x): C{/sys/class/net/<if>} and
C{/sys/class/infiniband/<dev>} are relative symbolic links into C{/sys/devices}; a PCI
function's directory holds C{net/<if>} and C{infiniband/<dev>}; an interface's C{device} link
points back at the function; an RDMA device's C{device} link does too (so
C{/sys/class/infiniband/<dev>/device/net/<if>} lists its netdevs); software devices live in
C{/sys/devices/virtual/net}; a bond has C{bonding/slaves} and C{lower_<slave>} links, a bridge
a C{bridge/} directory; C{type} is the ARPHRD number (1 ethernet, 32 InfiniBand, 772
loopback), C{flags} the hexadecimal IFF_* bits, C{speed} Mb/s or -1 when unknown.
Addresses are what psutil would report (C{addresses.json}); the tests feed them in.

 - C{gpu-node}: an InfiniBand HCA (mlx5_0, ib0), a dual-port RoCE NIC (mlx5_1/mlx5_2, one port
   up, one down with speed -1), the management NIC with the default route, a bond of two
   NICs, docker0 with two veths, lo;
 - C{roce-lag}: RoCE over a bond (mlx5_bond_0: the RDMA device's GID names bond0), a VLAN
   on it, a virtio NIC, a tun device, a dummy device, tap and vnet, no readable route table.
"""

from __future__ import annotations

import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))


class Tree:
    def __init__(self, name: str) -> None:
        self.root = os.path.join(HERE, name)
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        self.addresses: dict[str, list[list[object]]] = {}

    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel.lstrip("/"))

    def write(self, rel: str, text: str) -> None:
        path = self.p(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def link(self, rel: str, target_abs: str) -> None:
        """A relative link at C{rel} to C{target_abs} (both paths inside the tree)."""
        path = self.p(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(os.path.relpath(self.p(target_abs), os.path.dirname(path)), path)

    def netdev(self, devpath: str, name: str, *, arphrd: int = 1, flags: str = "0x1003",
               operstate: str = "up", mtu: int = 1500, address: str = "", speed: str | None = None,
               pci: str | None = None, ifindex: int = 2) -> str:
        """An interface at C{<devpath>/net/<name>} and its /sys/class/net link."""
        d = f"{devpath}/net/{name}"
        for key, value in (("type", str(arphrd)), ("flags", flags), ("operstate", operstate),
                           ("mtu", str(mtu)), ("address", address or "00:00:00:00:00:00"),
                           ("ifindex", str(ifindex)), ("iflink", str(ifindex)),
                           ("carrier", "0" if operstate == "down" else "1")):
            self.write(f"{d}/{key}", value)
        if speed is not None:
            self.write(f"{d}/speed", speed)
        os.makedirs(self.p(f"{d}/statistics"), exist_ok=True)
        self.write(f"{d}/statistics/rx_bytes", "0")
        if pci is not None:
            self.link(f"{d}/device", pci)
            self.link(f"{d}/subsystem", "/sys/class/net")
        self.link(f"/sys/class/net/{name}", d)
        return d

    def pci_function(self, path: str, driver: str) -> str:
        self.write(f"{path}/vendor", "0x15b3" if driver == "mlx5_core" else "0x8086")
        self.write(f"{path}/class", "0x020000" if driver != "mlx5_ib" else "0x020700")
        os.makedirs(self.p(f"/sys/bus/pci/drivers/{driver}"), exist_ok=True)
        self.link(f"{path}/driver", f"/sys/bus/pci/drivers/{driver}")
        return path

    def rdma(self, pci: str, dev: str, *, link_layer: str, rate: str, state: str = "4: ACTIVE",
             ports: int = 1, gids: dict[int, list[str]] | None = None) -> None:
        d = f"{pci}/infiniband/{dev}"
        self.write(f"{d}/node_type", "1: CA")
        self.write(f"{d}/fw_ver", "20.39.1002")
        for port in range(1, ports + 1):
            self.write(f"{d}/ports/{port}/link_layer", link_layer)
            self.write(f"{d}/ports/{port}/rate", rate)
            self.write(f"{d}/ports/{port}/state", state)
            self.write(f"{d}/ports/{port}/phys_state", "5: LinkUp")
            for i, ndev in enumerate((gids or {}).get(port, [])):
                self.write(f"{d}/ports/{port}/gid_attrs/ndevs/{i}", ndev)
                self.write(f"{d}/ports/{port}/gid_attrs/types/{i}", "RoCE v2")
        self.link(f"{d}/device", pci)
        self.link(f"/sys/class/infiniband/{dev}", d)

    def addr(self, name: str, *entries: tuple[str, str, str | None]) -> None:
        fam = {"ipv4": 2, "ipv6": 10, "link": 17}
        self.addresses[name] = [[fam[f], a, m] for f, a, m in entries]

    def done(self) -> None:
        with open(self.p("addresses.json"), "w") as f:
            json.dump(self.addresses, f, indent=1, sort_keys=True)
            f.write("\n")


def gpu_node() -> None:
    t = Tree("gpu-node")
    virt = "/sys/devices/virtual/net"
    # lo
    t.netdev("/sys/devices/virtual", "lo", arphrd=772, flags="0x9", operstate="unknown",
             mtu=65536, ifindex=1)
    t.addr("lo", ("ipv4", "127.0.0.1", "255.0.0.0"), ("ipv6", "::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"))
    # management NIC (Intel, 1 GbE), default route
    eno1_pci = t.pci_function("/sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0", "igb")
    t.netdev(eno1_pci, "eno1", address="3c:ec:ef:01:02:03", speed="1000", pci=eno1_pci, ifindex=2)
    t.addr("eno1", ("ipv4", "192.0.2.10", "255.255.255.0"), ("ipv6", "fe80::3eec:efff:fe01:203%eno1", "ffff:ffff:ffff:ffff::"),
           ("link", "3c:ec:ef:01:02:03", None))
    # InfiniBand HCA (ConnectX-6, HDR): ib0 is IPoIB, type 32, 20-byte hardware address
    hca = t.pci_function("/sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0", "mlx5_core")
    t.netdev(hca, "ib0", arphrd=32, flags="0x1003", mtu=2044, speed="200000", pci=hca, ifindex=3,
             address="00:00:10:29:fe:80:00:00:00:00:00:00:b8:ce:f6:03:00:12:34:56")
    t.rdma(hca, "mlx5_0", link_layer="InfiniBand", rate="200 Gb/sec (4X HDR)")
    t.addr("ib0", ("ipv4", "10.20.0.5", "255.255.0.0"))
    # Dual-port RoCE NIC (ConnectX-6 Dx, 100 GbE): port 0 up with jumbo frames, port 1 down
    roce0 = t.pci_function("/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0", "mlx5_core")
    roce1 = t.pci_function("/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.1", "mlx5_core")
    t.netdev(roce0, "enp65s0f0np0", mtu=9000, speed="100000", pci=roce0, ifindex=4,
             address="b8:ce:f6:aa:bb:01")
    t.netdev(roce1, "enp65s0f1np1", flags="0x1003", operstate="down", mtu=1500, speed="-1",
             pci=roce1, ifindex=5, address="b8:ce:f6:aa:bb:02")
    t.rdma(roce0, "mlx5_1", link_layer="Ethernet", rate="100 Gb/sec (2X HDR)",
           gids={1: ["enp65s0f0np0", "enp65s0f0np0"]})
    t.rdma(roce1, "mlx5_2", link_layer="Ethernet", rate="40 Gb/sec (4X QDR)", state="1: DOWN")
    t.addr("enp65s0f0np0", ("ipv4", "10.30.0.5", "255.255.255.0"))
    # A bond of two 10 GbE ports (active-backup), with an address
    for i, fn in ((2, "0000:03:00.0"), (3, "0000:03:00.1")):
        pci = t.pci_function(f"/sys/devices/pci0000:00/0000:00:1d.0/{fn}", "ixgbe")
        d = t.netdev(pci, f"eno{i}", flags="0x1803", speed="10000", pci=pci, ifindex=4 + i,
                     address="3c:ec:ef:01:02:10")
        t.link(f"{d}/master", f"{virt}/bond0")
        t.link(f"{d}/upper_bond0", f"{virt}/bond0")
    bond = t.netdev("/sys/devices/virtual", "bond0", flags="0x1403", mtu=1500, speed="10000",
                    ifindex=8, address="3c:ec:ef:01:02:10")
    t.write(f"{bond}/bonding/slaves", "eno2 eno3")
    t.write(f"{bond}/bonding/mode", "active-backup 1")
    t.link(f"{bond}/lower_eno2", "/sys/devices/pci0000:00/0000:00:1d.0/0000:03:00.0/net/eno2")
    t.link(f"{bond}/lower_eno3", "/sys/devices/pci0000:00/0000:00:1d.0/0000:03:00.1/net/eno3")
    t.addr("bond0", ("ipv4", "198.51.100.7", "255.255.255.0"))
    # docker0 with two veths (a bridge has no speed: reading it fails, so no file here)
    d0 = t.netdev("/sys/devices/virtual", "docker0", flags="0x1003", ifindex=9,
                  address="02:42:8c:11:22:33")
    t.write(f"{d0}/bridge/stp_state", "0")
    t.write(f"{d0}/bridge/forward_delay", "1500")
    t.addr("docker0", ("ipv4", "172.17.0.1", "255.255.0.0"))
    for i, name in enumerate(("veth1a2b3c4", "vethd5e6f70")):
        v = t.netdev("/sys/devices/virtual", name, flags="0x1003", speed="10000", ifindex=10 + i,
                     address=f"a6:11:22:33:44:5{i}")
        t.write(f"{v}/iflink", str(40 + i))  # the peer is in the container's namespace
        t.link(f"{v}/master", f"{virt}/docker0")
        t.link(f"{v}/brport/bridge", f"{virt}/docker0")
        t.link(f"{d0}/lower_{name}", v)
        t.link(f"{d0}/brif/{name}", f"{v}/brport")
        t.addr(name, ("ipv6", f"fe80::a411:22ff:fe33:445{i}%{name}", "ffff:ffff:ffff:ffff::"))
    # The routing table: default via eno1 (metric 100), a backup default on bond0 (metric 200)
    t.write("/proc/net/route", "\n".join([
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT",
        "bond0\t00000000\t016433C6\t0003\t0\t0\t200\t00000000\t0\t0\t0",
        "eno1\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0",
        "eno1\t000200C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0",
        "ib0\t0000140A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0",
        "docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0",
    ]))
    t.done()


def roce_lag() -> None:
    t = Tree("roce-lag")
    virt = "/sys/devices/virtual/net"
    t.netdev("/sys/devices/virtual", "lo", arphrd=772, flags="0x9", operstate="unknown",
             mtu=65536, ifindex=1)
    t.addr("lo", ("ipv4", "127.0.0.1", "255.0.0.0"))
    pfs = []
    for i, fn in enumerate(("0000:c1:00.0", "0000:c1:00.1")):
        pci = t.pci_function(f"/sys/devices/pci0000:c0/0000:c0:01.1/{fn}", "mlx5_core")
        d = t.netdev(pci, f"enp193s0f{i}np{i}", flags="0x1803", mtu=9000, speed="200000",
                     pci=pci, ifindex=2 + i, address="94:6d:ae:00:00:01")
        t.link(f"{d}/master", f"{virt}/bond0")
        t.link(f"{d}/upper_bond0", f"{virt}/bond0")
        pfs.append((pci, d))
    bond = t.netdev("/sys/devices/virtual", "bond0", flags="0x1403", mtu=9000, speed="400000",
                    ifindex=4, address="94:6d:ae:00:00:01")
    t.write(f"{bond}/bonding/slaves", "enp193s0f0np0 enp193s0f1np1")
    t.write(f"{bond}/bonding/mode", "802.3ad 4")
    for _pci, d in pfs:
        t.link(f"{bond}/lower_{os.path.basename(d)}", d)
    # LAG: one RDMA device on the first PF whose GIDs name the bond and the VLAN on it
    t.rdma(pfs[0][0], "mlx5_bond_0", link_layer="Ethernet", rate="200 Gb/sec (2X HDR)",
           gids={1: ["bond0", "bond0", "bond0.100", "bond0.100"]})
    vlan = t.netdev("/sys/devices/virtual", "bond0.100", flags="0x1003", mtu=9000, speed="400000",
                    ifindex=5, address="94:6d:ae:00:00:01")
    t.link(f"{vlan}/lower_bond0", bond)
    t.link(f"{bond}/upper_bond0.100", vlan)
    t.addr("bond0.100", ("ipv4", "10.40.1.9", "255.255.255.0"))
    # A virtio NIC (the device link names the virtio device; its parent is the PCI function)
    vpci = t.pci_function("/sys/devices/pci0000:00/0000:00:03.0", "virtio-pci")
    vdev = f"{vpci}/virtio0"
    t.write(f"{vdev}/device", "0x0001")
    t.netdev(vdev, "ens3", flags="0x1003", speed="-1", pci=vdev, ifindex=6,
             address="52:54:00:12:34:56")
    t.addr("ens3", ("ipv4", "203.0.113.20", "255.255.255.0"))
    # A tun device (a VPN), "unknown" operstate but up and running
    tun = t.netdev("/sys/devices/virtual", "corpvpn", arphrd=65534, flags="0x10d1",
                   operstate="unknown", mtu=1420, speed="10", ifindex=7)
    t.write(f"{tun}/tun_flags", "0x1001")
    t.addr("corpvpn", ("ipv4", "100.64.3.4", "255.255.255.255"))
    # A software device of no known name sitting on nothing (`ip link add llmnet0 type dummy`)
    t.netdev("/sys/devices/virtual", "llmnet0", flags="0x83", operstate="unknown", mtu=1500,
             ifindex=10, address="76:1e:22:00:00:09")
    t.addr("llmnet0", ("ipv4", "10.99.0.1", "255.255.255.0"))
    # tap and vnet devices of VMs
    for i, name in enumerate(("tap0", "vnet3")):
        t.netdev("/sys/devices/virtual", name, flags="0x1103", speed="10", ifindex=8 + i)
    t.done()  # no /proc/net/route: no default route known


if __name__ == "__main__":
    gpu_node()
    roce_lag()
