"""
C{llmport-agent doctor}: checks a node and says, one line per finding, what is wrong and what to
do (backend DNS/TCP/TLS/clock, credential, Docker engine, NVIDIA toolkit, NVML and GPU health,
model store, state and env file permissions, the systemd unit, journald, Loki, Ray's ports,
RDMA). Read-only and bounded in time, safe next to a running agent.
"""

from llmport_agent.doctor.checks import CHECKS, Context
from llmport_agent.doctor.result import FAIL, OK, WARN, Finding, exit_status
from llmport_agent.doctor.run import diagnose, main, make_context

__all__ = ["CHECKS", "FAIL", "OK", "WARN", "Context", "Finding", "diagnose", "exit_status", "main", "make_context"]
