"""Memory tiers: arenas and allocators. Never imports index/ or transport/."""
