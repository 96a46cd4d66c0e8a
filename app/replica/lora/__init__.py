"""Adapters on a replica, leaves first: weights.py (LoraWeights), peft_config.py (adapter_config.json),
peft_format.py (read and validate a PEFT folder; the catalog's summary), dora.py (DoRA's per-output factors from
the base checkpoint), merge.py and peft_merges.py (merges as virtual adapters: cat, and PEFT's other combination
types), pools.py (device slots and the per-step LoRA plan), manager.py (registry, LRU tiers, loader) and
null.py (the engine's hooks when it serves the base model only)."""
