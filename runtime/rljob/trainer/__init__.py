"""Trainer backends. `torch` is here; every backend reuses `rljob.algo` for the RL math."""
