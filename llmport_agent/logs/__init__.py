# -*- test-case-name: tests.test_logs -*-
"""
Log shipping to Loki (protocol section 8).

 - L{loki.LokiShipper}: a thread-safe bounded queue plus a reactor-side flusher that pushes
   batches to C{<LOKI_URL>/loki/api/v1/push} with treq, retrying 429/5xx with backoff.
 - L{agent_source.AgentLogObserver}: the agent's own C{twisted.logger} events as Loki lines.
 - L{journald.JournaldSource}: the host journal, followed with C{journalctl --follow}.
 - L{redact.Redactor}: the secret scrubber every line passes through.
 - L{testing.FakeLoki}: a faithful in-process Loki push endpoint for tests.

Everything logged from this package lives in the C{llmport_agent.logs} namespace, which the
sources never ship (no feedback loop when Loki is down).
"""

from __future__ import annotations

LOG_NAMESPACE = "llmport_agent.logs"

__all__ = ["LOG_NAMESPACE"]
