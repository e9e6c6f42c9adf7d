"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): vLLM calls
`register()` in every process it loads plugins in, its EngineCore and worker processes included,
so what it sets up holds in processes this project never starts itself.

In vLLM's engine processes it freezes the garbage collector's heap when the interpreter exits
(`atexit`). A process that has imported torch and vLLM tracks ~700k objects, and the collections
`Py_Finalize` runs scan them all: ~2 s per process on a 2-core machine, after the last line of
work. An engine's `close()` waited for both (a spawned EngineCore waits for its worker's exit), ran
past vLLM's 5 s shutdown timeout and had its EngineCore killed; on CPU the EngineCore now runs in
the explorer's process (rl_engine.rollout.engine) and close() waits for the worker alone, still
~1 s less with the freeze. Frozen, the scans are skipped and the
memory goes back with the process as before; atexit handlers, module teardown and the exit
status are unchanged. vLLM itself does this in its EngineCore after a clean shutdown on ROCm
(`gc.freeze()` in `EngineCoreProc.run_engine_core`). Figures: tests/rl_engine/rollout/test_vllm_plugin.py.

What changes: cycles still unreachable at exit are not collected, so their `__del__` does not run
then (Python never promised it would), and triton's nanobind module reports its objects as
"leaked" on stderr (the engine log) as the process ends. The process that starts an engine is
left alone: its exit is its owner's business (`rft` skips the teardown altogether: cli/main.py).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing


def register() -> None:
    """vLLM's engine processes are multiprocessing children of the process that started the
    engine; the plugin loads there and in that process. vLLM may load plugins more than once."""
    if multiprocessing.parent_process() is not None:
        atexit.register(gc.freeze)
