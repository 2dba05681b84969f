"""Entry points: `python -m launch.run` (the main job) and `launch/submit.sh` (the same on a Ray cluster)."""
