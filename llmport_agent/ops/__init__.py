"""
What operators look at on the node: metrics, the bounded ops endpoint, the node's status words,
diagnostics, and the probe root's tools use to trust the agent on its port.
"""
