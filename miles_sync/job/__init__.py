"""The RL job that runs on Ray actors: the trainer worker, prompts and reward, the run report."""
