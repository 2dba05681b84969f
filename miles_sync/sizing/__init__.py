"""Projecting a sync on a real cluster from costs measured on the machine at hand.

`shapes` (the exported tensors an HF config implies), `collective` (the stated broadcast cost model), `costs` (the
measured costs record), `projection` (sync time, pause window and peak memory per transport), `published` (what
comparable systems published), `cli` (`python -m miles_sync.sizing`). Pure: no processes, no network, no ray.
"""
