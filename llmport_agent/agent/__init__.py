"""
The composition root: the agent service that wires the layers, its start, drain and listeners,
and the twistd plugin's service maker.
"""
