"""The roles of a run: the explorer, the trainer role, partial rollouts, and their entry points."""
