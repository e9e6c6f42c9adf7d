"""Rollout side: the vLLM rollout engine (`engine.py`) and its worker extension (`worker_ext.py`)."""
