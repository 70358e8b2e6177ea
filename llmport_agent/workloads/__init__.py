"""
Workloads on the Docker engine: the executor, container specs, local policy, images,
readiness, the command handlers and the health watcher.

Entry points for the composition root:

 - L{llmport_agent.workloads.engine.DockerEngine}: the docker-py executor service;
 - L{llmport_agent.workloads.handlers.WorkloadManager} and
   L{llmport_agent.workloads.handlers.workload_handler_specs}: the command handlers;
 - L{llmport_agent.workloads.health.HealthWatcher}: C{workload.health.*} events;
 - L{llmport_agent.workloads.diagnostics.engine_diagnostics}: the engine part of
   C{collect_diagnostics}.
"""
