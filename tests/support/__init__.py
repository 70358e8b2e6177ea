"""
Test infrastructure for the workload tests: a real Docker engine and registry
(L{docker_env}), a recording command context (L{context}), a loopback TCP proxy that
can stop forwarding (L{proxy}), and a stand-in for the backend's image-save endpoint
(L{imageserver}). See README.md beside this file.
"""
