"""Byte paths between a caller's buffer and an agent's arena: shm, tcp (rdma in a later issue).

Moves bytes only: never talks to the index (DESIGN.md §5)."""
