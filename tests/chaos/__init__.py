"""
The chaos suite: the agent against the stand-in backend (and Loki) through a proxy that cuts,
stalls, slows and corrupts, with backend restarts, engine restarts, kill -9 and a full disk;
every scenario ends with the shared invariant checks of L{tests.chaos.invariants}.
"""
