"""Rollout engines: the built-in CPU reference engine (`miles_sync.engine.reference`) and engine clients."""
