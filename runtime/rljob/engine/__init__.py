"""Rollout engines: the built-in `hf` server, the one client for it and SGLang, the launcher,
and the weight-sync sidecar that receives, verifies and installs each version."""
