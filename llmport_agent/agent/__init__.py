"""
The composition root: L{service.AgentService} builds every part and wires them; it imports the
parts, the parts never import it. Its lifecycle is L{startup.Startup} (start order),
L{drain.Drain} (stop signals, the drain) and L{drain.Teardown} (the stop in reverse order);
L{refresh.InventoryRefresh}, L{secrets.NodeSecrets} and the session L{listeners} are small parts
of its own; L{tap} is the twistd plugin's service maker.
"""
