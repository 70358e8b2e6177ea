"""
remove_workload when the container vanishes under it (protocol 4: "must succeed when the
container is already gone"), on the real engine: the container is listed, then removed by
someone else (an operator's `docker rm -f`, a `--rm` container exiting) before the agent's own
stop or remove reaches the engine. The command still succeeds.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.workloads import containers as ops

from .support.rig import WorkloadTestBase, httpd_payload, ids_of


class RemoveGoneTests(WorkloadTestBase):
    def vanish_before(self, name: str) -> list[str]:
        """Make ops.<name> find its container already removed (force) by someone else."""
        real = getattr(ops, name)
        calls: list[str] = []

        def racing(client: Any, ident: str, *args: Any) -> Any:
            calls.append(ident)
            client.api.remove_container(ident, force=True)
            return real(client, ident, *args)

        self.patch(ops, name, racing)
        return calls

    async def test_container_gone_before_remove(self) -> None:
        payload = httpd_payload()
        await self.rig.run("deploy_workload", payload)
        await self.rig.run("stop_workload", ids_of(payload))
        calls = self.vanish_before("remove")
        _ctx, result = await self.rig.run("remove_workload", ids_of(payload))
        self.assertEqual(len(calls), 1, "the race was not exercised")
        self.assertEqual(result["runtime_id"], payload["runtime_id"])
        self.assertEqual(result["removed"], 0)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])

    async def test_container_gone_before_stop(self) -> None:
        """Running when listed, gone when the agent stops it before removing."""
        payload = httpd_payload()
        await self.rig.run("deploy_workload", payload)
        calls = self.vanish_before("stop")
        _ctx, result = await self.rig.run("remove_workload", ids_of(payload))
        self.assertEqual(len(calls), 1, "the race was not exercised")
        self.assertEqual(result["removed"], 0)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])
        await deferLater(reactor, 0, lambda: None)

    def test_ops_remove_of_unknown_container(self) -> None:
        """containers.remove of an id the engine does not know: False, no exception."""
        client = self.env.client()
        self.assertFalse(ops.remove(client, "0" * 64))
        self.assertFalse(ops.stop(client, "0" * 64, 1))


class _FlakyAPI:
    """remove_container fails with Podman's between-states error C{fails} times."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.calls = 0

    def remove_container(self, ident: str, force: bool) -> None:
        import docker

        self.calls += 1
        if self.calls <= self.fails:
            raise docker.errors.APIError(
                "500 Server Error", explanation=f"cannot remove container {ident} as it could not be "
                "stopped: sending SIGKILL to container: container state improper: stopped")


class RemoveBetweenStatesTests(SynchronousTestCase):
    """
    Podman's forced remove of a container its restart policy is starting or stopping again
    fails with "container state improper" (seen as a failed rollback of an update): tried
    again, a bounded number of times.
    """

    def client(self, fails: int) -> Any:
        class Client:
            api = _FlakyAPI(fails)

        return Client()

    def test_retried_until_it_goes(self) -> None:
        client, slept = self.client(2), []
        self.assertTrue(ops.remove(client, "abc", sleep=slept.append))
        self.assertEqual((client.api.calls, slept), (3, [ops.REMOVE_RETRY_SEC] * 2))

    def test_bounded(self) -> None:
        import docker

        client, slept = self.client(100), []
        with self.assertRaises(docker.errors.APIError):
            ops.remove(client, "abc", sleep=slept.append)
        self.assertEqual(client.api.calls, ops.REMOVE_TRIES)
        self.assertEqual(len(slept), ops.REMOVE_TRIES - 1)

    def test_other_errors_not_retried(self) -> None:
        import docker

        class API:
            calls = 0

            def remove_container(self, ident: str, force: bool) -> None:
                API.calls += 1
                raise docker.errors.APIError("500 Server Error", explanation="driver failed")

        class Client:
            api = API()

        with self.assertRaises(docker.errors.APIError):
            ops.remove(Client(), "abc", sleep=lambda s: self.fail("slept"))
        self.assertEqual(API.calls, 1)


class _RestartingAPI:
    """A container whose restart policy starts it again after the first C{comebacks} stops."""

    def __init__(self, comebacks: int, exists: bool = True) -> None:
        self.comebacks = comebacks
        self.exists = exists
        self.stops = 0
        self.running = True

    def stop(self, ident: str, timeout: int) -> None:
        import docker

        if not self.exists:
            raise docker.errors.NotFound("no such container")
        self.stops += 1
        self.running = self.stops <= self.comebacks  # the engine started it again

    def inspect_container(self, ident: str) -> dict[str, Any]:
        return {"State": {"Running": self.running, "Restarting": False}}


class StopForGoodTests(SynchronousTestCase):
    """
    A container that failed its start is stopped and kept stopped: Podman's restart policy
    starts it again after a stop that found it already exited (seen as a deploy test's
    container "running" after the failure).
    """

    def client(self, api: Any) -> Any:
        class Client:
            pass

        Client.api = api
        return Client()

    def test_stopped_again_while_it_comes_back(self) -> None:
        api, slept = _RestartingAPI(comebacks=2), []
        self.assertTrue(ops.stop_for_good(self.client(api), "abc", 1, sleep=slept.append))
        self.assertEqual((api.stops, api.running), (3, False))
        # Watched for the whole window: a restart may come a second after the exit.
        self.assertEqual(slept, [ops.STOP_CHECK_SEC] * ops.STOP_TRIES)

    def test_one_stop_when_it_stays_stopped(self) -> None:
        api = _RestartingAPI(comebacks=0)
        self.assertTrue(ops.stop_for_good(self.client(api), "abc", 1, sleep=lambda s: None))
        self.assertEqual(api.stops, 1)

    def test_a_late_comeback_is_stopped(self) -> None:
        """Stopped at the first look, running at a later one (Podman's restart a second on)."""
        api, looks = _RestartingAPI(comebacks=0), []

        def sleep(seconds: float) -> None:
            looks.append(seconds)
            if len(looks) == 3:
                api.running = True  # the restart policy started it again

        self.assertTrue(ops.stop_for_good(self.client(api), "abc", 1, sleep=sleep))
        self.assertEqual((api.stops, api.running), (2, False))

    def test_bounded(self) -> None:
        api = _RestartingAPI(comebacks=100)
        self.assertTrue(ops.stop_for_good(self.client(api), "abc", 1, sleep=lambda s: None))
        self.assertEqual(api.stops, 1 + ops.STOP_TRIES)

    def test_gone(self) -> None:
        api = _RestartingAPI(comebacks=0, exists=False)
        self.assertFalse(ops.stop_for_good(self.client(api), "abc", 1, sleep=lambda s: None))
