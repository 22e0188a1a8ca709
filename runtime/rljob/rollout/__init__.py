"""The rollout worker and what it owns: prompts and their order (`tasks`, `data_source`),
reward and generate hooks, the `Sample` record and the figures of a batch and an eval."""
