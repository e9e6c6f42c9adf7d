"""Prefect deployments of the mode flows (declarative; see prefect.yaml and serve.py)."""
