"""rl_engine package."""
