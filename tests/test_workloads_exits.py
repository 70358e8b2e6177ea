"""
The real last exit of a container (L{llmport_agent.workloads.exits}), with a fake docker-py
client: after the restart policy restarted a crashed workload, C{State.ExitCode} says 0; the
engine's C{die} event keeps the real code and the time of the exit.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.workloads.exits import UNKNOWN_EXIT, exit_info, last_die
from llmport_agent.workloads.readiness import ContainerExit, describe_exit

CID = "c0ffee" * 10 + "abcd"


def inspect_doc(
    *, running: bool, restarting: bool = False, exit_code: int = 0, restarts: int = 0, started: str = ""
) -> dict[str, Any]:
    return {
        "Id": CID,
        "Name": "/llm-port-x",
        "Created": "2026-01-02T03:04:05.123456789Z",
        "RestartCount": restarts,
        "State": {
            "Status": "restarting" if restarting else ("running" if running else "exited"),
            "Running": running,
            "Restarting": restarting,
            "ExitCode": exit_code,
            "Error": "",
            "OOMKilled": False,
            "StartedAt": started,
        },
        "Config": {"Labels": {}, "Env": []},
        "HostConfig": {},
    }


class FakeAPI:
    def __init__(self, info: dict[str, Any], dies: list[tuple[int, int]]) -> None:
        self.info = info
        self.dies = dies  # (exitCode, timeNano)
        self.events_calls: list[dict[str, Any]] = []
        self.logs_calls: list[dict[str, Any]] = []

    def inspect_container(self, ident: str) -> dict[str, Any]:
        return self.info

    def events(self, **kwargs: Any) -> Any:
        self.events_calls.append(kwargs)
        for code, nano in self.dies:
            yield {
                "Type": "container",
                "Action": "die",
                "Actor": {"ID": CID, "Attributes": {"exitCode": str(code), "name": "llm-port-x"}},
                "time": nano // 10**9,
                "timeNano": nano,
            }

    def logs(self, ident: str, **kwargs: Any) -> bytes:
        self.logs_calls.append(kwargs)
        return b"boom\n"


class FakeClient:
    def __init__(self, api: FakeAPI) -> None:
        self.api = api


T0 = 1_767_323_045_000_000_000  # ns


class ExitInfoTests(SynchronousTestCase):
    def test_restarted_container_reports_the_real_exit(self) -> None:
        """Running again after a restart (ExitCode 0): the die event's code (3) is reported."""
        api = FakeAPI(inspect_doc(running=True, restarts=1), [(3, T0)])
        info = exit_info(FakeClient(api), CID)  # type: ignore[arg-type]
        assert info is not None
        self.assertEqual(info["exit_code"], 3)
        self.assertEqual(info["restart_count"], 1)
        # Logs up to the exit, not the new run's.
        self.assertAlmostEqual(api.logs_calls[0]["until"], T0 / 1e9 + 0.05, places=3)
        call = api.events_calls[0]
        # "died" for Podman, whose compat API filters by its own event name (tests.test_workloads_podman).
        self.assertEqual(call["filters"], {"type": "container", "container": CID, "event": ["die", "died"]})
        self.assertLessEqual(call["since"], 1_767_323_045)

    def test_the_next_run_s_lines_are_not_the_exit_s(self) -> None:
        """Restarted within the clock's slack (Podman): the lines end where the next run began."""
        api = FakeAPI(inspect_doc(running=True, restarts=1, started="2026-01-02T03:04:05.020000000Z"), [(7, T0)])
        info = exit_info(FakeClient(api), CID)  # type: ignore[arg-type]
        assert info is not None
        self.assertAlmostEqual(api.logs_calls[0]["until"], 1_767_323_045.02, places=4)
        # A start long after the exit (a restart delay) leaves the slack as it is.
        api = FakeAPI(inspect_doc(running=True, restarts=1, started="2026-01-02T03:04:09Z"), [(7, T0)])
        exit_info(FakeClient(api), CID)  # type: ignore[arg-type]
        self.assertAlmostEqual(api.logs_calls[0]["until"], T0 / 1e9 + 0.05, places=4)

    def test_newest_die_wins(self) -> None:
        """Several exits: the newest one counts."""
        api = FakeAPI(inspect_doc(running=True, restarts=2), [(3, T0), (7, T0 + 5 * 10**9)])
        info = exit_info(FakeClient(api), CID)  # type: ignore[arg-type]
        assert info is not None
        self.assertEqual(info["exit_code"], 7)

    def test_exited_container(self) -> None:
        """A stopped container: its die event, else State.ExitCode; all of its last lines."""
        api = FakeAPI(inspect_doc(running=False, exit_code=3), [])
        info = exit_info(FakeClient(api), CID)  # type: ignore[arg-type]
        assert info is not None
        self.assertEqual(info["exit_code"], 3)
        self.assertNotIn("until", api.logs_calls[0])

    def test_unknown_after_restart_without_event(self) -> None:
        """Running again and no die event left: 'unknown', never a false 0."""
        api = FakeAPI(inspect_doc(running=True, restarts=1), [])
        info = exit_info(FakeClient(api), CID)  # type: ignore[arg-type]
        assert info is not None
        self.assertEqual(info["exit_code"], UNKNOWN_EXIT)
        text = describe_exit("llm-port-x", ContainerExit("running", UNKNOWN_EXIT, 1, "boom"))
        self.assertIn("exit code unknown", text)

    def test_running_never_restarted(self) -> None:
        """A healthy first run is not an exit."""
        api = FakeAPI(inspect_doc(running=True), [(3, T0)])
        self.assertIsNone(exit_info(FakeClient(api), CID))  # type: ignore[arg-type]
        self.assertEqual(api.events_calls, [])

    def test_last_die_ignores_malformed(self) -> None:
        """Events without a numeric exitCode are skipped."""
        api = FakeAPI(inspect_doc(running=True), [])

        def events(**kwargs: Any) -> Any:
            yield {"Actor": {"Attributes": {"exitCode": "x"}}, "timeNano": T0}
            yield "garbage"
            yield {"Actor": {"Attributes": {"exitCode": "2"}}, "timeNano": T0}

        api.events = events  # type: ignore[method-assign]
        self.assertEqual(last_die(FakeClient(api), CID, None)["exit_code"], 2)  # type: ignore[arg-type,index]
