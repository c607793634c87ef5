"""Pure decisions: placement, transport choice, what an agent frees. No I/O; time is passed in."""
