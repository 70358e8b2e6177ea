"""
The AMD and Apple GPU sources (issue 13), the source choice, and the tool runner.

Recorded real outputs are quoted exactly, each with where it was published; where the public
record is cut, the cut text is used as what it then is, a malformed document. Documents that
are put together from a recorded text or XML output (not a recorded JSON one) say so.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from llmport_agent.inventory import fakes_amd
from llmport_agent.inventory.amd import ROCM_SMI_ARGS, AMDGPUSource, parse_rocm_smi, render_node_for
from llmport_agent.inventory.apple import AppleGPUSource, parse_displays
from llmport_agent.inventory.collector import assert_no_nulls
from llmport_agent.inventory.fakes_amd import AMDSMI_STATUS, FakeAMDGPU, FakeAMDSMI
from llmport_agent.inventory.gpu import IGPUSource, NoGPUSource
from llmport_agent.inventory.nvml import NVMLGPUSource
from llmport_agent.inventory.select import choose_vendor, make_gpu_source
from llmport_agent.inventory.tools import ToolResult, run_tool
from llmport_agent.inventory.watchdog import WatchdogPool

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1024 * 1024

# ------------------------------------------------------------------ recorded outputs

#: `rocm-smi --showproductname --showuse --showmeminfo vram --json`, Radeon RX 7900 XT,
#: published in marimo-team/marimo issue #9237 (2026-04-16).
ROCM_SMI_RX7900XT = """{
  "card0": {
    "GPU use (%)": "0",
    "VRAM Total Memory (B)": "21458059264",
    "VRAM Total Used Memory (B)": "27856896",
    "Card Series": "Radeon RX 7900 XT",
    "Card Model": "0x744c",
    "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
    "Card SKU": "D70401XT",
    "Subsystem ID": "0x471e",
    "Device Rev": "0xcc",
    "Node ID": "1",
    "GUID": "26967",
    "GFX Version": "gfx1100"
  }
}
"""

#: `rocm-smi --json --showmemuse` on two RX 6800s (ROCm SMI 1.4.1), the "before" output in
#: ROCm/rocm_smi_lib pull request #120 (2023-04-13): no VRAM byte counts at all.
ROCM_SMI_2X_RX6800_MEMUSE = """{
  "card0": {
    "GPU memory use (%)": "0",
    "Memory Activity": "N/A"
  },
  "card1": {
    "GPU memory use (%)": "0",
    "Memory Activity": "N/A"
  }
}"""

#: `rocm-smi -f -t -P --json` in 2019 (lower-case "(c)"), RainbowMiner/RainbowMiner issue #749.
ROCM_SMI_2019 = (
    '{"card0": {"Fan Speed (%)": "45", "Average Graphics Package Power (W)": "222.0", '
    '"Temperature (Sensor mem) (c)": "79.0", "Fan Speed (level)": "117", '
    '"Temperature (Sensor junction) (c)": "103.0", "Temperature (Sensor edge) (c)": "77.0"}}'
)

#: `rocm-smi --json --showrasinfo` on MI300A, ROCm/legacy-rocm-build issue #4374 (2025-02-14).
ROCM_SMI_NO_JSON = "WARNING: No JSON data to report\n"

#: rocm-smi-lib 6.2.4 on a Radeon 780M, sebhildebrandt/systeminformation pull request #960
#: (2025-01-18): the record available here ends inside a key, so this is a cut document.
ROCM_SMI_780M_CUT = """{
    "card0": {
        "Device Name": "Phoenix3",
        "Device ID": "0x1900",
        "Device Rev": "0x01",
        "Subsystem ID": "0xe001",
        "GUID": "45560",
        "Unique ID": "N/A",
        "VBIOS version": "113-PHXGENERIC-001",
        "Temperature (Sensor edge) (C)": "31.0",
        "fclk clock speed:": "(400Mhz)",
        "fclk clock level:": "0",
        "mclk clock speed:": "(400Mhz)",
        "mclk clock level:": "0",
        "sclk clock speed:": "(800Mhz)",
        "sclk clock level:": "0",
        "socclk clock speed:": "(400Mhz)",
        "socclk clock level:": "0",
        "Performance Level": "auto",
        "Current Socket Graphics Package Power (W)": "7.222",
        "GPU use (%)": "19",
        "GPU Memory Allocated (VRAM%)": "87",
        "Memory Activity": "N/A",
        "PCIe Replay Count": "0",
        "Serial Number": "N/A",
        "Voltage (mV)": "752",
        "PCI Bus": "0000:C4:00.0",
        "ASD firmware version": "0x210000e7",
        "ME firmware version": "40",
        "MEC firmware version": "40",
        "MES firmware version": "0x0000006e",
        "MES KIQ firmware version": "0x00000073",
        "PFP firmware version": "48",
        "RLC firmware ver"""

#: `system_profiler SPDisplaysDataType -json` on an M1 (macOS 11), exelban/stats issue #394
#: (2021-03-31): the record ends inside the display list, so this is a cut document.
APPLE_M1_CUT = """{
  "SPDisplaysDataType" : [
    {
      "_name" : "kHW_AppleM1Item",
      "spdisplays_metalfamily" : "spdisplays_mtlgpufamilyapple7",
      "spdisplays_ndrvs" : [
        {
          "_name" : "Color LCD",
          "_spdisplays_display-product-id" : "a03c",
          "_spdisplays_display-serial-number" : "...",
          "_spdisplays_display-vendor-id" : "610","""

#: `system_profiler SPDisplaysDataType -json`, M3 Pro with two external displays,
#: timmo001/system-bridge pull request #3408 (2025-04-16): also cut in the record here.
APPLE_M3_PRO_CUT = """{
  "SPDisplaysDataType" : [
    {
      "_name" : "Apple M3 Pro",
      "spdisplays_mtlgpufamilysupport" : "spdisplays_metal3",
      "spdisplays_ndrvs" : [
        {
          "_name" : "DELL U2722DE",
          "_spdisplays_display-product-id" : "4231","""

#: Put together (not recorded as JSON): the fields of the recorded text output of
#: `system_profiler SPDisplaysDataType` on an Apple M3 in narugit/smctemp issue #26
#: (Chipset Model: Apple M3, Type: GPU, Bus: Built-In, Total Number of Cores: 10, Vendor:
#: Apple (0x106b), Metal Support: Metal 3), under the JSON keys of the records above and of
#: the plist in duanefields/VirtualKVM issue #50 (sppci_model, sppci_device_type, sppci_bus).
APPLE_M3_FROM_TEXT = json.dumps(
    {
        "SPDisplaysDataType": [
            {
                "_name": "Apple M3",
                "sppci_model": "Apple M3",
                "sppci_device_type": "spdisplays_gpu",
                "sppci_bus": "spdisplays_builtin",
                "sppci_cores": "10",
                "spdisplays_vendor": "sppci_vendor_Apple",
                "spdisplays_mtlgpufamilysupport": "spdisplays_metal3",
            }
        ]
    }
)

#: Put together from the plist (`system_profiler -xml SPDisplaysDataType`) of an Intel Mac
#: recorded in duanefields/VirtualKVM issue #50 (2017): its keys and values, as JSON.
INTEL_MAC_FROM_XML = json.dumps(
    {
        "SPDisplaysDataType": [
            {
                "_name": "kHW_IntelIris6100Item",
                "_spdisplays_vram": "1536 MB",
                "spdisplays_device-id": "0x162b",
                "sppci_bus": "spdisplays_builtin",
                "sppci_device_type": "spdisplays_gpu",
                "sppci_model": "Intel Iris Graphics 6100",
            }
        ]
    }
)


def recorded(*outputs: str, returncode: int = 0, error: str = "") -> Any:
    """A tool runner answering with the given outputs in turn (the last one repeats)."""
    calls: list[Sequence[str]] = []
    queue = list(outputs)

    def run(argv: Sequence[str], timeout: float) -> ToolResult:
        calls.append(tuple(argv))
        text = queue.pop(0) if len(queue) > 1 else queue[0]
        return ToolResult(returncode, text, "", error)

    run.calls = calls  # type: ignore[attr-defined]
    return run


# ----------------------------------------------------------------------------- rocm-smi


class RocmSmiParseTests(SynchronousTestCase):
    def test_rx7900xt(self) -> None:
        (dev,), driver, error = parse_rocm_smi(ROCM_SMI_RX7900XT)
        self.assertEqual(error, "")
        self.assertEqual(dev["name"], "Radeon RX 7900 XT")
        self.assertEqual(dev["memory_total_bytes"], 21458059264)
        self.assertEqual(dev["memory_used_bytes"], 27856896)
        self.assertEqual(dev["utilization_pct"], 0)

    def test_two_cards_without_vram_bytes(self) -> None:
        devices, _, error = parse_rocm_smi(ROCM_SMI_2X_RX6800_MEMUSE)
        self.assertEqual(error, "")
        self.assertEqual([d["index"] for d in devices], [0, 1])
        self.assertEqual([d["memory_total_bytes"] for d in devices], [0, 0])

    def test_2019_lower_case_units(self) -> None:
        (dev,), _, _ = parse_rocm_smi(ROCM_SMI_2019)
        self.assertEqual(dev["temperature_c"], 77)
        self.assertEqual(dev["power_draw_w"], 222.0)

    def test_no_json_and_cut_json(self) -> None:
        devices, _, error = parse_rocm_smi(ROCM_SMI_NO_JSON)
        self.assertEqual(devices, [])
        self.assertEqual(error, "rocm-smi printed no JSON (WARNING: No JSON data to report)")
        devices, _, error = parse_rocm_smi(ROCM_SMI_780M_CUT)
        self.assertEqual(devices, [])
        self.assertIn("malformed JSON", error)
        for text in ("", "[1, 2]", '{"system": {}}', '{"card0": "x"}', "{" * 100_000):
            devices, _, error = parse_rocm_smi(text)
            self.assertEqual(devices, [])
            self.assertNotEqual(error, "")

    def test_780m_before_the_cut(self) -> None:
        """The fields before the cut, closed off: newer key names (Device Name, socket power)."""
        text = ROCM_SMI_780M_CUT.rsplit(",", 1)[0] + "}}"
        (dev,), _, error = parse_rocm_smi(text)
        self.assertEqual(error, "")
        self.assertEqual((dev["name"], dev["pci_bus_id"], dev["uuid"]), ("Phoenix3", "0000:C4:00.0", ""))
        self.assertEqual((dev["temperature_c"], dev["power_draw_w"], dev["utilization_pct"]), (31, 7.222, 19))


class RocmSmiSourceTests(SynchronousTestCase):
    def source(self, run: Any, **kw: Any) -> AMDGPUSource:
        def no_amdsmi() -> Any:
            raise ImportError("No module named 'amdsmi'")

        return AMDGPUSource(importer=no_amdsmi, run=run, **kw)

    def test_snapshot_and_fallback(self) -> None:
        run = recorded(ROCM_SMI_RX7900XT)
        source = self.source(run)
        self.assertTrue(verifyObject(IGPUSource, source))
        snap = source.snapshot()
        self.assertEqual(source.backend, "rocm-smi")
        self.assertEqual(run.calls, [ROCM_SMI_ARGS])
        d = snap.to_dict()
        self.assertEqual((d["count"], d["vendor"], d["source"]), (1, "amd", "rocm-smi"))
        self.assertEqual(d["devices"][0]["name"], "Radeon RX 7900 XT")
        self.assertEqual(d["total_vram_bytes"], 21458059264)
        assert_no_nulls(d)
        source.check_health()  # no second run: rocm-smi has no RAS counts
        self.assertEqual(len(run.calls), 1)

    def test_failure_fails_closed_for_gpus_seen(self) -> None:
        run = recorded(ROCM_SMI_RX7900XT, ROCM_SMI_NO_JSON)
        source = self.source(run)
        self.assertEqual(source.snapshot().count, 1)
        snap = source.snapshot()
        self.assertEqual((snap.count, snap.device_count), (0, 1))
        self.assertIn("no JSON", snap.gpu_error)
        self.assertEqual(snap.devices[0].name, "Radeon RX 7900 XT")
        self.assertEqual(snap.devices[0].state, "unhealthy")

    def test_not_installed_says_both(self) -> None:
        source = self.source(recorded("", error="rocm-smi is not installed (not on PATH)"))
        snap = source.snapshot()
        self.assertEqual(snap.count, 0)
        self.assertIn("rocm-smi is not installed", snap.gpu_error)
        self.assertIn("No module named 'amdsmi'", snap.gpu_error)

    def test_render_node_from_sysfs(self) -> None:
        root = self.mktemp()
        os.makedirs(os.path.join(root, "bus/pci/devices/0000:c4:00.0/drm/renderD129"))
        os.makedirs(os.path.join(root, "bus/pci/devices/0000:c4:00.0/drm/card1"))
        self.assertEqual(render_node_for("0000:C4:00.0", root), "/dev/dri/renderD129")
        self.assertEqual(render_node_for("../../etc", root), "")
        text = ROCM_SMI_780M_CUT.rsplit(",", 1)[0] + "}}"
        snap = self.source(recorded(text), sysfs_root=root).snapshot()
        self.assertEqual(snap.devices[0].render_node, "/dev/dri/renderD129")


# ------------------------------------------------------------------------------- amdsmi

#: Values the AMD SMI library gave, as `amd-smi static` printed them in ROCm/rocm-systems
#: pull request #2987 (MI350X: market name, BDF 0000:05:00.0, amdgpu 6.18.3) and in
#: gpustack/gpustack issue #3509 (MI60 / MI50: ASIC serial, 32752 MB VRAM).
def recorded_amd_node() -> FakeAMDSMI:
    return FakeAMDSMI(
        [
            FakeAMDGPU(
                market_name="AMD Instinct MI350X",
                bdf="0000:05:00.0",
                uuid="GPU-mi350x-0",
                vram_total_mb=294896,
                vram_used_mb=283,
                driver_version="6.18.3",
                drm_render=128,
            ),
            FakeAMDGPU(
                market_name="AMD Instinct MI60 / MI50",
                bdf="0000:43:00.0",
                uuid="GPU-mi50-1",
                asic_serial="0x53B050417326B1E3",
                vram_total_mb=32752,
                edge_temp=None,  # answered NOT_SUPPORTED: hotspot is read instead
                hotspot_temp=51,
                drm_render=129,
            ),
        ]
    )


class FakeAMDSMIFaithfulnessTests(SynchronousTestCase):
    def test_signatures_match_amdsmi_7_0_2(self) -> None:
        """Each fake function has the parameters of amdsmi 7.0.2's (recorded with ast)."""
        with open(os.path.join(HERE, "data", "amdsmi_7.0.2_api.json")) as f:
            api = json.load(f)
        fake = FakeAMDSMI([])
        self.assertEqual(set(fakes_amd.FAKE_FUNCTIONS) - set(api["functions"]), set())
        for name in fakes_amd.FAKE_FUNCTIONS:
            params = list(inspect.signature(getattr(fake, name)).parameters)
            self.assertEqual(params, api["functions"][name], name)
        for enum, members in api["enums"].items():
            self.assertEqual([m for m in members if hasattr(getattr(fakes_amd, enum), m)], members, enum)
        self.assertEqual(fakes_amd.AMDSMI_STATUS["NOT_SUPPORTED"], api["status"]["AMDSMI_STATUS_NOT_SUPPORTED"])
        self.assertTrue(issubclass(fake.AmdSmiLibraryException, fake.AmdSmiException))


class AMDSMISourceTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.smi = recorded_amd_node()
        self.source = AMDGPUSource(amdsmi=self.smi, pool=WatchdogPool("t", synchronous=True))

    def test_figures(self) -> None:
        d = self.source.snapshot().to_dict()
        self.assertEqual(self.source.backend, "amdsmi")
        self.assertEqual(d["count"], 2)
        mi350, mi50 = d["devices"]
        self.assertEqual((mi350["name"], mi350["pci_bus_id"], mi350["driver_version"]), ("AMD Instinct MI350X", "0000:05:00.0", "6.18.3"))
        self.assertEqual(mi350["render_node"], "/dev/dri/renderD128")
        self.assertEqual(mi50["serial"], "0x53B050417326B1E3")
        self.assertEqual(mi50["memory_total_mib"], 32752)
        self.assertEqual(mi50["temperature_c"], 51)
        self.assertEqual(mi50["health"], "healthy")
        self.assertEqual(d["driver_version"], "6.18.3")
        assert_no_nulls(d)

    def test_ras_uncorrectable_counts_rising_then_reset(self) -> None:
        self.source.snapshot()
        self.smi.gpus[1].ecc = {"correctable_count": 4, "uncorrectable_count": 2, "deferred_count": 0}
        self.source.check_health()
        h = self.source.health()[1]
        self.assertEqual(h.state, "unhealthy")
        self.assertIn("2 uncorrectable ECC error(s)", h.reasons[0])
        self.assertEqual(self.source.snapshot().count, 1)
        self.smi.gpus[1].ecc = {"correctable_count": 0, "uncorrectable_count": 0, "deferred_count": 0}
        self.source.check_health()
        self.assertEqual(self.source.health()[1].state, "healthy")
        self.assertEqual([t.event_type for t in self.source.tracker.drain()], ["gpu.health.unhealthy", "gpu.health.recovered"])

    def test_error_vs_not_supported(self) -> None:
        self.smi.fail("amdsmi_get_gpu_total_ecc_count", AMDSMI_STATUS["NOT_SUPPORTED"], device=0)
        self.smi.fail("amdsmi_get_gpu_total_ecc_count", AMDSMI_STATUS["API_FAILED"], device=1)
        snap = self.source.snapshot()
        self.assertEqual(snap.devices[0].state, "healthy")
        self.assertEqual(snap.devices[1].state, "unhealthy")
        self.assertIn("AMD SMI query ecc failed", snap.devices[1].health.reasons[0])  # type: ignore[union-attr]

    def test_init_failure_falls_back_to_rocm_smi(self) -> None:
        smi = FakeAMDSMI([], init_error=AMDSMI_STATUS["DRIVER_NOT_LOADED"])
        source = AMDGPUSource(amdsmi=smi, run=recorded(ROCM_SMI_RX7900XT))
        self.assertEqual(source.snapshot().count, 1)
        self.assertEqual(source.backend, "rocm-smi")

    def test_hung_library_marks_gpus_unresponsive(self) -> None:
        source = AMDGPUSource(amdsmi=self.smi, call_timeout=0.2)
        self.assertEqual(source.snapshot().count, 2)
        release = self.smi.hang("amdsmi_get_gpu_vram_usage")
        self.addCleanup(release.set)
        start = time.monotonic()
        snap = source.snapshot()
        self.assertLess(time.monotonic() - start, 5)
        self.assertEqual(snap.count, 0)
        self.assertIn("amdsmi_get_gpu_vram_usage", snap.gpu_error)
        self.assertTrue(all(h.unresponsive for h in source.health().values()))
        self.assertIn("has not returned", source.snapshot().gpu_error)
        release.set()
        deadline = time.monotonic() + 5
        while source.pool.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(source.snapshot().count, 2)

    def test_close(self) -> None:
        self.source.snapshot()
        self.source.close()
        self.assertFalse(self.smi.initialized)


# -------------------------------------------------------------------------------- Apple


class AppleTests(SynchronousTestCase):
    def source(self, *outputs: str, **kw: Any) -> AppleGPUSource:
        return AppleGPUSource(
            run=recorded(*outputs, **kw), memory=lambda: (24 << 30, 10 << 30), os_version=lambda: "14.5"
        )

    def test_m3_unified_memory(self) -> None:
        source = self.source(APPLE_M3_FROM_TEXT)
        self.assertTrue(verifyObject(IGPUSource, source))
        d = source.snapshot().to_dict()
        (dev,) = d["devices"]
        self.assertEqual((d["vendor"], d["count"]), ("apple", 1))
        self.assertEqual((dev["name"], dev["vendor"], dev["cores"]), ("Apple M3", "apple", 10))
        self.assertTrue(dev["unified_memory"])
        self.assertEqual(dev["memory_total_bytes"], 24 << 30)
        self.assertEqual(dev["memory_free_bytes"], 10 << 30)
        self.assertEqual(dev["driver_version"], "macOS 14.5")
        assert_no_nulls(d)

    def test_m1_name_key_and_cut_outputs(self) -> None:
        rows, error = parse_displays(APPLE_M1_CUT)
        self.assertEqual(rows, [])
        self.assertIn("malformed JSON", error)
        rows, error = parse_displays(APPLE_M3_PRO_CUT)
        self.assertIn("malformed JSON", error)
        # The complete keys of the M1 record: its name is a localisation key.
        complete = '{"SPDisplaysDataType": [{"_name": "kHW_AppleM1Item", "spdisplays_metalfamily": "spdisplays_mtlgpufamilyapple7"}]}'
        (row,), error = parse_displays(complete)
        self.assertEqual((row["name"], row["vendor"], row["cores"]), ("Apple M1", "apple", 0))

    def test_intel_mac(self) -> None:
        d = self.source(INTEL_MAC_FROM_XML).snapshot().to_dict()
        (dev,) = d["devices"]
        self.assertEqual((dev["vendor"], dev["memory_total_mib"], dev["unified_memory"]), ("intel", 1536, False))
        self.assertEqual(d["vendor"], "none")  # not a vendor the backend knows

    def test_failure_fails_closed_and_malformed_inputs(self) -> None:
        source = self.source(APPLE_M3_FROM_TEXT, APPLE_M3_PRO_CUT)
        self.assertEqual(source.snapshot().count, 1)
        snap = source.snapshot()
        self.assertEqual((snap.count, snap.device_count), (0, 1))
        self.assertIn("malformed JSON", snap.gpu_error)
        for text in ("", "null", '{"SPDisplaysDataType": {}}', '{"SPDisplaysDataType": [1, "x", {}]}'):
            rows, error = parse_displays(text)
            self.assertEqual(rows, [])
            self.assertNotEqual(error, "")

    def test_timeout(self) -> None:
        snap = self.source("", error="system_profiler did not finish within 10 s").snapshot()
        self.assertIn("did not finish", snap.gpu_error)


# --------------------------------------------------------------------- choice and tools


class ChoiceTests(SynchronousTestCase):
    def test_choose(self) -> None:
        yes, no = (lambda: True), (lambda: False)
        self.assertEqual(choose_vendor("auto", platform="darwin", has_nvml=yes, has_amd=yes), "apple")
        self.assertEqual(choose_vendor("auto", platform="linux", has_nvml=yes, has_amd=yes), "nvidia")
        self.assertEqual(choose_vendor("auto", platform="linux", has_nvml=no, has_amd=yes), "amd")
        self.assertEqual(choose_vendor("auto", platform="linux", has_nvml=no, has_amd=no), "nvidia")
        self.assertEqual(choose_vendor("amd", platform="darwin", has_nvml=yes, has_amd=no), "amd")

    def test_nvml_probe_needs_no_temporary_files_or_tools(self) -> None:
        """The unit's sandbox (read-only /, no usable temp dir): auto still chooses, no subprocess."""
        import subprocess
        import tempfile

        from llmport_agent.inventory import select

        def refused(*a: object, **kw: object) -> None:
            raise AssertionError("the NVML probe ran a program or made a temporary file")

        self.patch(tempfile, "gettempdir", refused)
        self.patch(tempfile, "NamedTemporaryFile", refused)
        self.patch(subprocess, "Popen", refused)
        self.assertIsInstance(select._has_nvml(), bool)
        self.assertIn(choose_vendor("auto", platform="linux"), ("nvidia", "amd"))

    def test_make(self) -> None:
        self.assertIsInstance(make_gpu_source("nvidia"), NVMLGPUSource)
        self.assertIsInstance(make_gpu_source("amd"), AMDGPUSource)
        self.assertIsInstance(make_gpu_source("apple"), AppleGPUSource)
        none = make_gpu_source("none")
        self.assertIsInstance(none, NoGPUSource)
        self.assertIn("GPU_SOURCE=none", none.snapshot().gpu_error)


class ToolRunnerTests(SynchronousTestCase):
    def test_runs_times_out_and_reports_missing(self) -> None:
        ok = run_tool(["echo", "hi"], 5)
        self.assertEqual((ok.returncode, ok.stdout, ok.error), (0, "hi\n", ""))
        start = time.monotonic()
        slow = run_tool(["sleep", "10"], 0.2)
        self.assertLess(time.monotonic() - start, 5)
        self.assertIn("did not finish within 0.2 s", slow.error)
        self.assertIn("not installed", run_tool(["llmport-no-such-tool"], 1).error)

    def test_output_is_bounded_while_it_is_read(self) -> None:
        """
        A tool printing far more than the bound (here 256 MiB against 1 MiB) is stopped there:
        the runner never holds more than the bound (before, it buffered everything, and a tool
        printing 1.5 GB took the agent to 2.4 GB RSS). Measured in a fresh interpreter.
        """
        import subprocess
        import sys

        script = (
            "from llmport_agent.inventory.tools import run_tool\n"
            "r = run_tool(['sh', '-c', 'head -c 268435456 /dev/zero; echo done >&2'], 60, max_output=1 << 20)\n"
            "print(r.error)\n"
            # VmHWM: this interpreter's own peak (ru_maxrss would include a forking parent's).
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
        )
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=root), cwd=root)
        self.assertEqual(done.returncode, 0, done.stderr)
        error, maxrss_kib = done.stdout.strip().splitlines()
        self.assertIn("printed more than 1048576 bytes", error)
        self.assertLess(int(maxrss_kib), 120 * 1024)
        tail = run_tool(["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' e >&2; echo ok"], 30)
        self.assertEqual((tail.returncode, tail.stdout), (0, "ok\n"))
        self.assertEqual(len(tail.stderr), 4096)
