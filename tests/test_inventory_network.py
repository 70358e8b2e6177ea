"""
Tests for L{llmport_agent.inventory.network}: the C{inventory.network} object (protocol 10.5)
read from fixture trees of real sysfs layouts (C{tests/data/sysfs}, written by its
C{make_fixtures.py}: an InfiniBand HCA, a RoCE NIC, a bond, docker0 and veths; RoCE over a
bond with a VLAN, virtio, tun, tap).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.inventory.collector import assert_no_nulls
from llmport_agent.inventory.network import NetworkReader, default_route, read_network, tier1

DATA = os.path.join(os.path.dirname(__file__), "data", "sysfs")

#: The fields of a fabric the backend's planner reads (protocol 10.5), all known here.
FABRIC_KEYS = {
    "interface", "ip", "netmask", "cidr", "speed_gbps", "speed_mbps", "link_type",
    "rdma_device", "pci_address", "mtu", "operstate", "has_default_route", "is_virtual", "is_up",
}


def addresses_of(tree: str) -> dict[str, Any]:
    with open(os.path.join(DATA, tree, "addresses.json")) as f:
        return json.load(f)


def read(tree: str, **kw: Any) -> dict[str, Any]:
    addrs = addresses_of(tree)
    return NetworkReader(os.path.join(DATA, tree), addresses=lambda: addrs, **kw).read()


def by_name(items: list[dict[str, Any]], key: str = "interface") -> dict[str, dict[str, Any]]:
    return {i[key]: i for i in items}


class FixtureTreeTests(SynchronousTestCase):
    """The fixtures are what a kernel shows (so the tests below read real layouts)."""

    def test_class_entries_are_links_into_devices(self) -> None:
        """/sys/class/net and /sys/class/infiniband entries are relative links into /sys/devices."""
        root = os.path.join(DATA, "gpu-node")
        for cls in ("sys/class/net", "sys/class/infiniband"):
            for name in os.listdir(os.path.join(root, cls)):
                path = os.path.join(root, cls, name)
                self.assertTrue(os.path.islink(path), path)
                self.assertFalse(os.path.isabs(os.readlink(path)))
                self.assertIn("/sys/devices/", os.path.realpath(path))
        ib = os.path.join(root, "sys/class/infiniband/mlx5_0/device/net/ib0")
        self.assertTrue(os.path.isdir(ib))
        with open(os.path.join(root, "sys/class/net/ib0/type")) as f:
            self.assertEqual(f.read().strip(), "32")


class GPUNodeTests(SynchronousTestCase):
    """A GPU node: InfiniBand, RoCE (one port down), management NIC, bond, docker0 + veths."""

    def setUp(self) -> None:
        self.net = read("gpu-node")
        self.fabrics = by_name(self.net["fabrics"])
        self.all = by_name(self.net["all_interfaces"], "name")

    def test_infiniband(self) -> None:
        """ib0 (type 32, HCA mlx5_0 with link layer InfiniBand) is infiniband with its device."""
        ib0 = self.fabrics["ib0"]
        self.assertEqual(ib0["link_type"], "infiniband")
        self.assertEqual(ib0["rdma_device"], "mlx5_0")
        self.assertEqual(ib0["pci_address"], "0000:01:00.0")
        self.assertEqual((ib0["speed_mbps"], ib0["speed_gbps"]), (200000, 200.0))
        self.assertEqual((ib0["ip"], ib0["netmask"], ib0["cidr"]), ("10.20.0.5", "255.255.0.0", "10.20.0.0/16"))
        self.assertEqual(ib0["mtu"], 2044)
        self.assertIs(ib0["is_virtual"], False)

    def test_roce(self) -> None:
        """The RoCE port (RDMA device with an Ethernet link layer) is roce, jumbo MTU, its PCI function."""
        roce = self.fabrics["enp65s0f0np0"]
        self.assertEqual(roce["link_type"], "roce")
        self.assertEqual(roce["rdma_device"], "mlx5_1")
        self.assertEqual(roce["pci_address"], "0000:41:00.0")
        self.assertEqual(roce["mtu"], 9000)
        self.assertEqual(roce["speed_gbps"], 100.0)
        self.assertIs(roce["is_up"], True)

    def test_down_port_speed_unknown(self) -> None:
        """A port that is down: speed -1 is unknown (absent, also not taken from a DOWN IB port's rate)."""
        down = self.all["enp65s0f1np1"]
        self.assertNotIn("speed_mbps", down)
        self.assertNotIn("speed_gbps", down)
        self.assertEqual(down["operstate"], "down")
        self.assertIs(down["is_up"], False)
        self.assertEqual(down["link_type"], "roce")
        self.assertNotIn("enp65s0f1np1", self.fabrics)  # no IPv4 address

    def test_bond_is_a_real_link(self) -> None:
        """bond0 lives under devices/virtual but sits on NICs: ethernet, not virtual, slaves named."""
        bond = self.fabrics["bond0"]
        self.assertEqual(bond["link_type"], "ethernet")
        self.assertIs(bond["is_virtual"], False)
        self.assertNotIn("pci_address", bond)
        self.assertEqual(self.all["bond0"]["bond_slaves"], ["eno2", "eno3"])
        self.assertEqual(self.all["eno2"]["pci_address"], "0000:03:00.0")

    def test_docker_bridge_is_virtual(self) -> None:
        """docker0 has an IPv4 address: it is a fabric entry, typed virtual, so the planner rejects it."""
        d0 = self.fabrics["docker0"]
        self.assertEqual(d0["link_type"], "virtual")
        self.assertIs(d0["is_virtual"], True)
        self.assertNotIn("speed_mbps", d0)

    def test_veths_counted_not_listed(self) -> None:
        """The two veths are counted in omitted_ephemeral_interfaces and absent from every list."""
        self.assertEqual(self.net["omitted_ephemeral_interfaces"], 2)
        names = set(self.all) | set(self.fabrics)
        self.assertFalse([n for n in names if n.startswith("veth")])

    def test_loopback_not_a_fabric(self) -> None:
        """lo has 127.0.0.1 but is never a fabric; it is listed as loopback, up (flags + carrier)."""
        self.assertNotIn("lo", self.fabrics)
        self.assertEqual(self.all["lo"]["link_type"], "loopback")
        self.assertIs(self.all["lo"]["is_up"], True)

    def test_default_route(self) -> None:
        """Of two default routes the lowest metric wins (eno1, listed second in the table)."""
        self.assertEqual(self.net["default_route_interface"], "eno1")
        self.assertEqual(self.net["default_route_ip"], "192.0.2.10")
        self.assertEqual(self.net["management_ip"], "192.0.2.10")
        self.assertEqual(self.net["default_gateway"], "192.0.2.1")
        flagged = [n for n, f in self.fabrics.items() if f["has_default_route"]]
        self.assertEqual(flagged, ["eno1"])

    def test_fabric_shape(self) -> None:
        """Fabrics are exactly the IPv4 interfaces less lo; a fully known one has every 10.5 field."""
        self.assertEqual(sorted(self.fabrics), ["bond0", "docker0", "eno1", "enp65s0f0np0", "ib0"])
        self.assertEqual(set(self.fabrics["ib0"]), FABRIC_KEYS)
        for f in self.net["fabrics"]:
            self.assertLessEqual(set(f), FABRIC_KEYS)
        assert_no_nulls(self.net)
        json.dumps(self.net, allow_nan=False)

    def test_tier1(self) -> None:
        """What the backend copies into capabilities: everything but all_interfaces."""
        t1 = tier1(self.net)
        self.assertNotIn("all_interfaces", t1)
        self.assertEqual(t1["fabrics"], self.net["fabrics"])


class RoceLagTests(SynchronousTestCase):
    """RoCE over a bond (LAG) with a VLAN, a virtio NIC, a tun VPN, tap/vnet, no route table."""

    def setUp(self) -> None:
        self.net = read("roce-lag")
        self.fabrics = by_name(self.net["fabrics"])
        self.all = by_name(self.net["all_interfaces"], "name")

    def test_roce_over_bond_and_vlan(self) -> None:
        """The LAG device's GIDs name bond0 and bond0.100: both are roce on mlx5_bond_0."""
        vlan = self.fabrics["bond0.100"]
        self.assertEqual((vlan["link_type"], vlan["rdma_device"]), ("roce", "mlx5_bond_0"))
        self.assertEqual(self.all["bond0"]["rdma_device"], "mlx5_bond_0")
        self.assertIs(vlan["is_virtual"], False)

    def test_virtio_pci_address(self) -> None:
        """A virtio NIC's device link names virtio0: the PCI address is its parent's; speed -1 unknown."""
        ens3 = self.fabrics["ens3"]
        self.assertEqual(ens3["pci_address"], "0000:00:03.0")
        self.assertEqual(ens3["link_type"], "ethernet")
        self.assertNotIn("speed_mbps", ens3)

    def test_tun_virtual_and_up(self) -> None:
        """A tun device is virtual; operstate unknown with IFF_UP and a carrier counts as up."""
        vpn = self.fabrics["corpvpn"]
        self.assertEqual(vpn["link_type"], "virtual")
        self.assertEqual(vpn["operstate"], "unknown")
        self.assertIs(vpn["is_up"], True)

    def test_no_route_table(self) -> None:
        """Without /proc/net/route nothing is guessed: no default route anywhere."""
        for key in ("default_route_interface", "default_route_ip", "management_ip"):
            self.assertNotIn(key, self.net)
        self.assertFalse([f for f in self.net["fabrics"] if f["has_default_route"]])

    def test_software_device_on_nothing_is_virtual(self) -> None:
        """A device under devices/virtual with no lower_* link and no known name is virtual."""
        self.assertEqual(self.fabrics["llmnet0"]["link_type"], "virtual")

    def test_tap_vnet_counted(self) -> None:
        """tap0 and vnet3 are ephemeral: counted, not listed."""
        self.assertEqual(self.net["omitted_ephemeral_interfaces"], 2)
        self.assertNotIn("tap0", self.all)
        self.assertNotIn("vnet3", self.all)


class BoundsTests(SynchronousTestCase):
    """Caps, odd values, missing pieces."""

    def test_interface_cap_keeps_fabrics_first(self) -> None:
        """With room for 3, the IPv4 interfaces come first; the rest is counted."""
        net = read("gpu-node", max_interfaces=3)
        self.assertEqual(len(net["all_interfaces"]), 3)
        self.assertTrue(all(i["ips"] and i["ips"][0]["family"] == "ipv4" for i in net["all_interfaces"]))
        # 9 interfaces that are not per-container: 6 left out.
        self.assertEqual(net["omitted_interfaces"], 6)

    def copy_tree(self) -> str:
        root = self.mktemp()
        shutil.copytree(os.path.join(DATA, "gpu-node"), root, symlinks=True)
        return root

    def test_odd_speed_values(self) -> None:
        """0, 4294967295 (an unsigned -1) and junk are unknown speeds; files are read bounded."""
        root = self.copy_tree()
        addrs = addresses_of("gpu-node")
        for value in ("0", "4294967295", "fast", "9" * 100_000):
            with open(os.path.join(root, "sys/class/net/eno1/speed"), "w") as f:
                f.write(value + "\n")
            net = NetworkReader(root, addresses=lambda: addrs).read()
            eno1 = by_name(net["fabrics"])["eno1"]
            self.assertNotIn("speed_mbps", eno1, value[:20])

    def test_link_layer_decides_infiniband(self) -> None:
        """Without a readable type, the HCA port's link layer InfiniBand still makes ib0 infiniband."""
        root = self.copy_tree()
        os.unlink(os.path.join(root, "sys/class/net/ib0/type"))
        addrs = addresses_of("gpu-node")
        ib0 = by_name(NetworkReader(root, addresses=lambda: addrs).read()["fabrics"])["ib0"]
        self.assertEqual((ib0["link_type"], ib0["rdma_device"]), ("infiniband", "mlx5_0"))

    def test_ephemeral_with_address(self) -> None:
        """A veth holding an IPv4 address is a fabric entry (virtual) but still not listed."""
        addrs = addresses_of("gpu-node")
        addrs["veth1a2b3c4"] = [[2, "169.254.7.1", "255.255.0.0"]]
        net = NetworkReader(os.path.join(DATA, "gpu-node"), addresses=lambda: addrs).read()
        self.assertEqual(by_name(net["fabrics"])["veth1a2b3c4"]["link_type"], "virtual")
        self.assertNotIn("veth1a2b3c4", by_name(net["all_interfaces"], "name"))
        self.assertEqual(net["omitted_ephemeral_interfaces"], 2)

    def test_non_linux_falls_back_to_addresses(self) -> None:
        """No /sys/class/net: the interfaces come from the addresses, facts minimal, no crash."""
        addrs = addresses_of("gpu-node")
        net = NetworkReader(self.mktemp(), addresses=lambda: addrs).read()
        self.assertEqual(sorted(by_name(net["fabrics"])), ["bond0", "docker0", "eno1", "enp65s0f0np0", "ib0"])
        self.assertEqual(net["omitted_ephemeral_interfaces"], 2)
        assert_no_nulls(net)

    def test_addresses_failing(self) -> None:
        """psutil failing leaves the sysfs facts, with no fabric (no address known)."""

        def broken() -> Any:
            raise OSError("netlink gone")

        net = NetworkReader(os.path.join(DATA, "gpu-node"), addresses=broken).read()
        self.assertEqual(net["fabrics"], [])
        self.assertIn("ib0", by_name(net["all_interfaces"], "name"))

    def test_real_host(self) -> None:
        """The machine running the tests: a valid object, JSON, no nulls."""
        net = read_network()
        json.dumps(net, allow_nan=False)
        assert_no_nulls(net)
        self.assertIn("omitted_ephemeral_interfaces", net)


class DefaultRouteTests(SynchronousTestCase):
    """Parsing /proc/net/route."""

    HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"

    def test_ignores_non_default_down_and_junk(self) -> None:
        """A host route, a route that is not up, a short line and junk hex are skipped."""
        text = self.HEADER + "\n".join([
            "eth9\t000200C0\t010200C0\t0003\t0\t0\t0\t00FFFFFF\t0\t0\t0",  # not default
            "eth8\t00000000\t010200C0\t0002\t0\t0\t0\t00000000\t0\t0\t0",  # not up
            "eth7\t00000000",
            "eth6\tZZZZ\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0",
            "eth5\t00000000\t010200C0\t0003\t0\t0\t50\t00000000\t0\t0\t0",
        ])
        self.assertEqual(default_route(text), ("eth5", "192.0.2.1"))
        self.assertIsNone(default_route(self.HEADER))
        self.assertIsNone(default_route(""))
