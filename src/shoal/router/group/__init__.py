"""A router group: the processes of one router sharing a port, the bus between them, and what
they share over it."""
