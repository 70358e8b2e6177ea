"""
Multi-node inference on Ray (protocol 10.6): the runtime bundle and its local policy
(L{bundle}), the image pin (L{imagepin}), the runtime container (L{container}), bounded
C{docker exec} (L{execs}), the cluster token (L{token}), the in-image helper CLI
(L{helpercli}) and the command handlers (L{handlers}).

The host never runs Ray: every Ray process lives in the one long-lived container
C{llm-port-ray-runtime}, started from a digest-pinned image as C{sleep infinity}, and the
agent runs C{ray start}/C{ray stop} and the helper inside it with C{docker exec}.
"""
