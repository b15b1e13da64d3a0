"""Parallelism: the mesh and its sharding rules (sharding.py), process-local rows <-> global
arrays (multihost.py), arrays between two meshes (transfer.py), and the watchdog that stops a
multi-process job when one process dies (peers.py)."""
