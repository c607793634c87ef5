"""The node agent: owns this node's arenas, serves their bytes, keeps the index in step."""
