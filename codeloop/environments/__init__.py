"""Example environments in TRL's form (`rollout.environment`, docs/environments.md)."""
