"""Thin Prefect tasks around engine calls (rl_engine/). No engine logic lives here."""
