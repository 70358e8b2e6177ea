"""
The hostile suite: the agent under attack from the backend, the network, its workloads and
an unlucky operator. One module per area; each test names the attack in its docstring and
fails if the hole it guards reopens.
"""
