"""Checkpoint storage: atomic, verified publication (`store`), the single-writer lease
(`lease`) and the random-number state (`rng`). Nothing here knows what a checkpoint holds."""
