"""Adapters on a replica: PEFT reading and validation, merges, device pools, and the manager (registry, LRU, loader)."""
