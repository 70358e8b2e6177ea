"""
Trying the agent: the one-node demo, the Ray demo, and fakes shipped for tests and embedding.
"""
