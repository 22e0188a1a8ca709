"""Rollout engines: the built-in `hf` server, the one client for it and SGLang, and the launcher."""
