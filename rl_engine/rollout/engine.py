"""The rollout engine: a live vLLM `LLM` that samples rollouts and takes weight updates in place.

Same code on the CPU build (tests, laptops) and the CUDA build (clusters). Build it with the
explicit factory and keep it for the whole run; weight syncs (`rl_engine.sync`) load new
weights into it without a restart and record the version they installed.

    engine = build_rollout_engine(cfg, explorer_id=0)
    groups = engine.generate([[5, 6, 7], [8, 9]], n=4, sampling=cfg.explorer.sampling, seed=1)
    groups[0][3].response_ids, groups[0][3].logprobs, engine.version
    engine.close()

Behavior logprobs (what the trainer must compute to match): vLLM runs with
`logprobs_mode="processed_logprobs"`, so `Rollout.logprobs[j]` is the log-probability of the
sampled token under the distribution the token was actually drawn from:
log_softmax(logits / temperature) in float32. With top_k disabled (-1) and top_p = 1.0 (the
defaults) that is exactly what the trainer computes, `log_softmax(logits / temperature)`.
With top_k / top_p on, it is the truncated, renormalised distribution (tokens outside the
nucleus have probability 0); a trainer that wants to match must apply the same truncation.
At temperature 0 (greedy) vLLM returns log_softmax(logits) (temperature 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from rl_engine.config import EngineConfig, RFTConfig, SamplingConfig
from rl_engine.errors import UserError

WORKER_EXTENSION = "rl_engine.rollout.worker_ext.RFTWorkerExtension"
_GIB = 1 << 30
_CPU_TOKEN_BUDGET = 4096  # vLLM's CPU default for max_num_batched_tokens
# Env changes for one engine start are process-wide: serialise starts from several threads.
_START_LOCK = threading.Lock()


class EngineDiedError(RuntimeError):
    """The vLLM engine process is gone (crashed, killed, or closed); build a new engine."""


@dataclass
class Rollout:
    """One sampled response to one prompt, with what the trainer needs to learn from it.

    `response_ids` holds every sampled token, EOS and the tokens of a matched stop string
    included; `text` is vLLM's detokenized text, which leaves the stop string out.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # behavior logprob of each response token (see module docstring)
    finish_reason: Literal["stop", "length"]
    version: int  # weight version of the engine that sampled it
    text: str = field(repr=False, default="")


class RolloutEngine(Protocol):
    """What explorers and weight syncs need from an inference engine."""

    @property
    def version(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> list[list[Rollout]]: ...

    def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call `method` of the worker extension on every inference worker; one result per worker."""
        ...

    def mark_synced(self, version: int) -> None:
        """Record that the workers now hold weights of `version` (called by rl_engine.sync)."""
        ...

    def close(self) -> None: ...


def request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One SamplingParams seed per prompt, all distinct, derived from `seed`.

    vLLM seeds the k-th of the n samples of a request with `seed + k`, so prompt i gets
    base + i * n: the ranges [base + i*n, base + (i+1)*n) never overlap, and the hashed base
    keeps calls with nearby seeds (1, 2, ...) from sharing streams.
    """
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8).digest()
    base = int.from_bytes(digest, "little") % (1 << 40)
    return [base + i * n for i in range(num_prompts)]


def _check_model_dir(path: str, what: str) -> None:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"{what} {path!r} does not exist; point it at a local Hugging Face model directory (or build one with `rft make-tiny-model`)")
    if what == "model.path" and not (p / "config.json").is_file():
        raise UserError(f"{what} {path!r} has no config.json; it must be a Hugging Face model directory")


@contextlib.contextmanager
def _engine_env(changes: dict[str, str | None]):
    """Apply env changes while vLLM builds its config and forks its processes, then restore."""
    old = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cpu_thread_bind(num_threads: int | None, explorer_id: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for one engine: explorer x gets cores [x*n, (x+1)*n) (wrapping)."""
    if num_threads is None:
        return None
    ncpu = os.cpu_count() or 1
    n = min(num_threads, ncpu)
    start = (explorer_id * n) % ncpu
    cores = [(start + i) % ncpu for i in range(n)]
    return ",".join(str(c) for c in cores)


class VLLMRolloutEngine:
    """A live vLLM `LLM` with the RFT worker extension; thread-safe (one call at a time)."""

    def __init__(self, model_path: str, tokenizer_path: str, dtype: str, max_model_len: int, engine: EngineConfig, seed: int = 0, explorer_id: int = 0):
        from vllm import LLM
        from vllm.platforms import current_platform

        self.max_model_len = max_model_len
        self.explorer_id = explorer_id
        self._version = 0
        self._lock = threading.RLock()
        self._closed = False
        kwargs: dict[str, Any] = dict(
            model=model_path,
            tokenizer=tokenizer_path,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=engine.enforce_eager,
            tensor_parallel_size=engine.tensor_parallel_size,
            seed=seed,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs",
        )
        env: dict[str, str | None] = {}
        if current_platform.is_cpu():
            # The config field is the one source of the KV cache size: the legacy
            # VLLM_CPU_KVCACHE_SPACE (whole GiB only) would override kv_cache_memory_bytes.
            kwargs["kv_cache_memory_bytes"] = int(engine.kv_cache_space_gib * _GIB)
            # A prompt prefilled in chunks makes vLLM rewind its seeded sampler with
            # Generator.set_offset, which CPU generators lack: the worker dies ("CPU Generator
            # does not use offset") once a batch's prompts exceed the token budget. Whole
            # prefills only; the budget must hold one full-length sequence.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(_CPU_TOKEN_BUDGET, max_model_len)
            env["VLLM_CPU_KVCACHE_SPACE"] = None
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_thread_bind(engine.num_threads, explorer_id) or os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        else:
            kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
        with _START_LOCK, _engine_env(env):
            self._llm = LLM(**kwargs)
        self._tokenizer = self._llm.get_tokenizer()

    # ---- properties

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def llm(self) -> Any:
        """The underlying `vllm.LLM` (benchmarks compare against its own generate)."""
        return self._llm

    # ---- generation

    def sampling_params(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> list[Any]:
        """The per-request vLLM SamplingParams `generate` uses (distinct seeds per prompt)."""
        from vllm import SamplingParams

        return [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),  # vLLM: 0 disables top-k
                max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None,
                logprobs=0,  # only the sampled token's logprob
                seed=s,
            )
            for s in request_seeds(seed, len(prompts), n)
        ]

    def _check_prompts(self, prompts: list[list[int]], n: int) -> None:
        if n < 1:
            raise UserError(f"generate: n = {n}; ask for at least one sample per prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise UserError(f"prompt {i} is empty; a prompt needs at least one token")
            if len(p) >= self.max_model_len:
                raise UserError(
                    f"prompt {i} has {len(p)} tokens, which leaves no room for a response within "
                    f"model.max_model_len = {self.max_model_len}; shorten the prompt or raise model.max_model_len"
                )

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> list[list[Rollout]]:
        """n samples per prompt in one batched vLLM call; result[i][k] is sample k of prompt i."""
        from vllm.inputs import TokensPrompt

        self._check_prompts(prompts, n)
        if not prompts:
            return []
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        params = self.sampling_params(prompts, n, sampling, seed)
        with self._lock:
            self._check_alive()
            version = self._version
            try:
                outputs = self._llm.generate(inputs, params, use_tqdm=False)
            except Exception as e:
                self._raise_if_dead(e)
                raise
        return [[_to_rollout(list(p), c, version) for c in sorted(out.outputs, key=lambda c: c.index)] for p, out in zip(prompts, outputs)]

    # ---- weight sync hooks

    def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        with self._lock:
            self._check_alive()
            try:
                return self._llm.collective_rpc(method, timeout=timeout, args=args)
            except Exception as e:
                self._raise_if_dead(e)
                raise

    def mark_synced(self, version: int) -> None:
        with self._lock:
            # Prefix-cache entries hold KV computed with the old weights; drop them. (The sync
            # tests resend the same prompts after a sync, so a stale cache fails them.)
            if not self._llm.reset_prefix_cache():
                raise RuntimeError(f"explorer {self.explorer_id}: vLLM refused to reset its prefix cache after loading version {version}")
            self._version = version

    # ---- lifecycle

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDiedError(f"rollout engine of explorer {self.explorer_id} was closed; build a new one")
        # vLLM notices a dead EngineCore asynchronously; a call that races its monitor can wait
        # forever on a reply that never comes, so look at the processes first.
        manager = getattr(getattr(self._llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        for proc in getattr(manager, "processes", None) or []:
            if proc.exitcode is not None:
                raise EngineDiedError(
                    f"the vLLM engine process of explorer {self.explorer_id} died (exit code {proc.exitcode}: crash, "
                    "out of memory, or killed); see its log above for the cause, then build a new engine"
                )

    def _raise_if_dead(self, e: Exception) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(e, EngineDeadError):
            raise EngineDiedError(
                f"the vLLM engine process of explorer {self.explorer_id} died (crash, out of memory, or killed); "
                "see its log above for the cause, then build a new engine"
            ) from e

    def close(self) -> None:
        """Stop the engine processes; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(Exception):
                self._llm.llm_engine.engine_core.shutdown()
            del self._llm

    def __enter__(self) -> "VLLMRolloutEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _to_rollout(prompt_ids: list[int], c: Any, version: int) -> Rollout:
    """A vLLM CompletionOutput -> Rollout (logprob of the sampled token at every position)."""
    ids = list(c.token_ids)
    if c.logprobs is None or len(c.logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprobs for {len(ids)} response tokens")
    logprobs = [float(c.logprobs[j][t].logprob) for j, t in enumerate(ids)]
    if c.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a generation with reason {c.finish_reason!r} (expected stop or length)")
    return Rollout(prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs, finish_reason=c.finish_reason, version=version, text=c.text)


def build_rollout_engine(cfg: RFTConfig, explorer_id: int = 0) -> RolloutEngine:
    """The rollout engine of explorer `explorer_id`, from `cfg.model` and `cfg.explorer.engine`."""
    m = cfg.model
    _check_model_dir(m.path, "model.path")
    tok = m.tokenizer_path or m.path
    _check_model_dir(tok, "model.tokenizer_path")
    return VLLMRolloutEngine(
        model_path=m.path,
        tokenizer_path=tok,
        dtype=m.dtype,
        max_model_len=m.max_model_len,
        engine=cfg.explorer.engine,
        seed=cfg.seed + explorer_id,
        explorer_id=explorer_id,
    )
