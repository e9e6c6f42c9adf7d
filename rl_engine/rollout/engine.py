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

Processes: on CPU vLLM's EngineCore (scheduler and step loop) runs in the process that builds
the engine and only its worker (the model) is spawned; vLLM's default, which the CUDA build
keeps, spawns the EngineCore too. Each spawned process imports torch and vLLM again, 6-7 s on
2 cores, and the EngineCore's process was one more hop in every model step.

Dead engines: vLLM's calls can wait without a timeout on a process that died (its synchronous
client is never woken when a spawned EngineCore dies). Here every blocking vLLM call runs in a
helper thread; the caller waits on it and meanwhile polls the engine's processes (EngineCore
and workers) every `_POLL_S` s. Once one is gone it fails what is pending inside vLLM (so the
helper returns too) and raises `EngineDiedError` naming the explorer and the process, within
`_POLL_S + _WAKE_GRACE_S` s of the death even if vLLM never wakes. `close()` never waits for a
call in flight. The engine processes also exit by themselves when the process that built the
engine dies (see `rl_engine.sync.worker_ext`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Literal

from rl_engine.adapter import synced_adapter
from rl_engine.api import RolloutEngine
from rl_engine.config import EngineConfig, LoRAConfig, RFTConfig, SamplingConfig
from rl_engine.errors import UserError
from rl_engine.model_dir import require_model_dir
from rl_engine.proc.starts import count_start
from rl_engine.rollout import inproc
from rl_engine.rollout.processes import EngineProcesses, wake_pending_calls

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rl_engine.sync.worker_ext.RFTWorkerExtension"
_GIB = 1 << 30
_CPU_TOKEN_BUDGET = 4096  # vLLM's CPU default for max_num_batched_tokens
# Env changes for one engine start are process-wide: serialise starts from several threads.
_START_LOCK = threading.Lock()
_POLL_S = 0.25  # how often a waiting call looks at the engine processes
_WAKE_GRACE_S = 2.0  # after a death, how long a woken vLLM call gets to fail by itself before the caller gives up on it
_SHUTDOWN_S = 10.0  # close(): how long vLLM's own shutdown may take before the processes are killed
_KILL_WAIT_S = 5.0  # close(): how long to wait for killed processes to exit


class EngineDiedError(RuntimeError):
    """The vLLM engine process is gone (crashed, killed, or closed); build a new engine."""


@dataclass
class Rollout:
    """One sampled response to one prompt, with what the trainer needs to learn from it.

    `response_ids` holds every sampled token, EOS and the tokens of a matched stop string
    included; `text` is the response decoded once from them without special tokens (with stop
    strings, vLLM's incremental text, which leaves the stop string out).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # behavior logprob of each response token (see module docstring)
    finish_reason: Literal["stop", "length", "repeat"]
    version: int  # weight version of the engine that sampled it
    text: str = field(repr=False, default="")


def request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One SamplingParams seed per prompt, all distinct, derived from `seed`.

    vLLM seeds the k-th of the n samples of a request with `seed + k`, so prompt i gets
    base + i * n: the ranges [base + i*n, base + (i+1)*n) never overlap, and the hashed base
    keeps calls with nearby seeds (1, 2, ...) from sharing streams.
    """
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8).digest()
    base = int.from_bytes(digest, "little") % (1 << 40)
    return [base + i * n for i in range(num_prompts)]


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


def _pin_own_devices() -> None:
    """Start this process's CUDA driver (cuInit reads CUDA_VISIBLE_DEVICES once) before an engine
    start changes the variable for its processes: a trainer that starts CUDA in another thread of
    this process meanwhile (placement local) must still see every device, not the engine's."""
    import torch

    torch.cuda.is_available()  # cudaGetDeviceCount: initialises the driver


def _cpu_thread_bind(num_threads: int | str | None, explorer_id: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for one engine: explorer x gets cores [x*n, (x+1)*n) (wrapping);
    "all": every core this process may run on (its affinity, resolved here, where the engine starts)."""
    if num_threads is None:
        return None
    if num_threads == "all":
        cores = (
            os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        )  # no affinity API off Linux
        return ",".join(str(c) for c in sorted(cores))
    ncpu = os.cpu_count() or 1
    n = min(num_threads, ncpu)
    start = (explorer_id * n) % ncpu
    cores = [(start + i) % ncpu for i in range(n)]
    return ",".join(str(c) for c in cores)


class VLLMRolloutEngine:
    """A live vLLM `LLM` with the RFT worker extension; thread-safe (one call at a time).

    Every call fails with `EngineDiedError` within about `_POLL_S + _WAKE_GRACE_S` s once an
    engine process is gone; `close()` returns within `_SHUTDOWN_S + _KILL_WAIT_S` s even while a
    call is stuck.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str,
        dtype: str,
        max_model_len: int,
        engine: EngineConfig,
        seed: int = 0,
        explorer_id: int = 0,
        cuda_visible: str | None = None,
        lora: LoRAConfig | None = None,
    ):
        from vllm import LLM
        from vllm.platforms import current_platform

        from rl_engine.proc.owner_watch import OWNER_PID_ENV

        self.max_model_len = max_model_len
        self.explorer_id = explorer_id
        self._version = 0
        self._lock = threading.RLock()  # one vLLM call at a time
        self._close_lock = threading.Lock()  # close() only: never waits for a call in flight
        self._closed = False
        self._dead: str | None = None  # which process died, once the engine is dead
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
        if lora is not None:
            # One adapter slot: each version's adapter replaces the last in place (worker_ext).
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=_lora_rank(lora.rank))
        # The engine processes inherit this and exit when this process is gone (worker_ext).
        env: dict[str, str | None] = {OWNER_PID_ENV: str(os.getpid())}
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
            # The CPU build runs eager (enforce_eager), yet vLLM's sampler torch.compiles one
            # helper (token ranks of sampled logprobs) with inductor on its first call: 1.8 s of
            # dynamo tracing and cache-key hashing in every engine start (~4 s on a cold inductor
            # cache), for a row-wise count that eager computes alike (bench.engine_start warm_up_s:
            # 1.84 -> 0.02 s). Dynamo off in the engine's processes only.
            env["TORCHDYNAMO_DISABLE"] = "1"
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_thread_bind(engine.num_threads, explorer_id) or os.environ.get(
                "VLLM_CPU_OMP_THREADS_BIND"
            )
            # The EngineCore (scheduler, the loop of model steps) runs in this process; only the
            # worker (the model, torch.distributed, its OpenMP threads) is spawned. vLLM's default
            # on CPU spawns the EngineCore too, a second process importing torch and vLLM: 6-7 s of
            # every engine start, and a hop (and a spinning reader on a core) in every model step.
            # (bench.engine_start: LLM() 14.4 -> 8.2 s; 64 x 8 tokens of the demo model 41.6 -> 29.7 ms,
            # and beside a training loop in this process 55.1 -> 38.4 ms while that loop's step
            # went 47.7 -> 38.6 ms.)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            kwargs["distributed_executor_backend"] = "mp"
        else:
            kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
            if cuda_visible is not None:
                _pin_own_devices()
                # The run's device plan (rl_engine.run.devices): the engine's processes see these
                # devices only, and are spawned (a fork after this process's CUDA start cannot use CUDA).
                env["CUDA_VISIBLE_DEVICES"] = cuda_visible
                env["VLLM_WORKER_MULTIPROC_METHOD"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") or "spawn"
        count_start("vllm_engine")
        with _START_LOCK, _engine_env(env), inproc.starting():
            self._llm = LLM(**kwargs)
        self._tokenizer = self._llm.get_tokenizer()
        self._client = self._llm.llm_engine.engine_core
        self._shutdown: Callable[[], None] = self._client.shutdown
        if (
            getattr(self._client, "engine_core", None) is not None
        ):  # an EngineCore in this process (vLLM's InprocClient)
            self._shutdown = inproc.adopt(self._client)
        self._procs = EngineProcesses(self._llm)
        self._lora_request, self._adapter_dir = None, None
        if lora is not None:
            self._serve_adapter(model_path, lora)

    def _serve_adapter(self, model_path: str, lora: LoRAConfig) -> None:
        """Serve the policy as the base model plus its adapter: the zero adapter (version 0) now,
        each synced version's in its place; every request names it (`_lora_request`). Its
        directory is where vLLM would reload it from, were it ever evicted (one adapter, never)."""
        import tempfile

        from vllm.lora.request import LoRARequest

        from rl_engine.adapter import ENGINE_ADAPTER_ID, peft_config, write_zero_adapter

        self._adapter_dir = write_zero_adapter(model_path, lora, tempfile.mkdtemp(prefix="rft-adapter-"))
        self.rpc("rft_adapter_init", peft_config(lora, model_path), self._adapter_dir)
        self._lora_request = LoRARequest("rft-policy", ENGINE_ADAPTER_ID, self._adapter_dir)

    # ---- properties

    def worker_rss(self) -> int:
        """Resident bytes of this engine's worker processes (benchmarks and tests of engine memory)."""
        return sum(p.memory_info().rss for p, _ in self._procs.workers)

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

    def sampling_params(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        seed: int,
        max_tokens: Sequence[int] | None = None,
        repeat: tuple[int, int] | None = None,
    ) -> list[Any]:
        """The per-request vLLM SamplingParams `generate` uses (distinct seeds per prompt)."""
        return [
            _sampling_params(fields) for fields in request_fields(len(prompts), n, sampling, seed, max_tokens, repeat)
        ]

    def _check_prompts(self, prompts: list[list[int]], n: int) -> None:
        _check_prompts(prompts, n, self.max_model_len)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        seed: int,
        max_tokens: Sequence[int] | None = None,
        repeat: tuple[int, int] | None = None,
    ) -> list[list[Rollout]]:
        """n samples per prompt in one batched vLLM call; result[i][k] is sample k of prompt i.

        `max_tokens[i]` overrides `sampling.max_tokens` for prompt i (a segment's budget);
        `repeat = (n, count)` stops a sample early (finish reason `repeat`) once its last
        1..n tokens have repeated `count` times in a row (vLLM's repetition detection).
        """
        from vllm.inputs import TokensPrompt

        self._check_prompts(prompts, n)
        if not prompts:
            return []
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        params = self.sampling_params(prompts, n, sampling, seed, max_tokens, repeat)
        with self._lock:
            self._check_alive()
            version = self._version
            outputs = self._call(
                "generate", lambda llm: llm.generate(inputs, params, use_tqdm=False, lora_request=self._lora_request)
            )
        # Text from vLLM where it detokenized (stop strings), else decoded here once from the ids.
        return [
            [
                _to_rollout(list(p), c, version, None if sp.detokenize else self._tokenizer)
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            for p, sp, out in zip(prompts, params, outputs)
        ]

    def generate_each(self, requests: Sequence[tuple[list[int], SamplingConfig, int]]) -> list[Rollout]:
        """One sample per (prompt ids, sampling, seed) request, in one batched vLLM call.

        Each request has its own settings and seed, so a request's sample does not depend on
        which others share the call (multi-turn episodes batch whatever turns are ready)."""
        from vllm.inputs import TokensPrompt

        prompts = [list(p) for p, _, _ in requests]
        self._check_prompts(prompts, 1)
        if not prompts:
            return []
        params = [
            _sampling_params(sampling_fields(sampling, 1, seed, sampling.max_tokens, None))
            for _, sampling, seed in requests
        ]
        with self._lock:
            self._check_alive()
            version = self._version
            outputs = self._call(
                "generate",
                lambda llm: llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in prompts],
                    params,
                    use_tqdm=False,
                    lora_request=self._lora_request,
                ),
            )
        return [
            _to_rollout(p, out.outputs[0], version, None if sp.detokenize else self._tokenizer)
            for p, sp, out in zip(prompts, params, outputs)
        ]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Checks and benchmarks: the engine's logprob of every token of each sequence given the
        tokens before it (vLLM's prompt logprobs, log_softmax of the raw logits: temperature 1),
        from the second token on; result[i] has len(sequences[i]) - 1 values. Scores a fixed
        response under the weights the engine holds now (no sampling)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_prompts(sequences, 1)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        with self._lock:
            outputs = self._call(
                "prompt_logprobs",
                lambda llm: llm.generate(
                    [TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
                    params,
                    use_tqdm=False,
                    lora_request=self._lora_request,
                ),
            )
        out = []
        for seq, o in zip(sequences, outputs):
            lps = o.prompt_logprobs  # [None, {token: Logprob, ...}, ...]
            out.append([float(lps[j][tok].logprob) for j, tok in enumerate(seq) if j > 0])
        return out

    # ---- weight sync hooks

    def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return self._call(f"rpc {method}", lambda llm: llm.collective_rpc(method, timeout=timeout, args=args))

    def mark_synced(self, version: int) -> None:
        with self._lock:
            # Prefix-cache entries hold KV computed with the old weights; drop them. (The sync
            # tests resend the same prompts after a sync, so a stale cache fails them.)
            if not self._call("reset_prefix_cache", lambda llm: llm.reset_prefix_cache()):
                raise RuntimeError(
                    f"explorer {self.explorer_id}: vLLM refused to reset its prefix cache after loading version {version}"
                )
            self._version = version

    # ---- lifecycle

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """`fn(llm)` under the call lock, in a helper thread this thread waits on.

        vLLM's blocking calls have no timeout; this wait ends within `_POLL_S + _WAKE_GRACE_S` s
        of an engine process dying (or of close()), even if vLLM never wakes the helper (which
        is then left behind, a daemon blocked on a dead engine).
        """
        with self._lock:
            self._check_alive()
            llm = self._llm
            fut: Future[Any] = Future()

            def run() -> None:
                try:
                    fut.set_result(fn(llm))
                except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                    fut.set_exception(e)

            threading.Thread(target=run, daemon=True, name=f"rft-explorer-{self.explorer_id}-{what}").start()
            gave_up_at: float | None = None
            while not wait_futures([fut], timeout=_POLL_S).done:
                if self._dead is None and not self._closed:
                    dead = self._procs.first_dead()
                    if dead is None:
                        continue
                    self._engine_died(dead)
                gave_up_at = gave_up_at or time.monotonic()
                if time.monotonic() - gave_up_at > _WAKE_GRACE_S:
                    raise self._died_error()
            try:
                return fut.result()
            except Exception as e:
                self._raise_if_dead(e)
                # vLLM can report a process death as a plain error first (a worker's RPC
                # "cancelled", a socket error) before anything marks the engine dead.
                if self._dead is None and not self._closed:
                    dead = self._procs.first_dead()
                    if dead is not None:
                        self._engine_died(dead)
                if self._dead is not None or self._closed:
                    raise self._died_error() from e
                raise

    def _died_error(self) -> EngineDiedError:
        dead = getattr(self, "_dead", None)
        if dead is not None:
            return EngineDiedError(
                f"the vLLM engine of explorer {self.explorer_id} died ({dead}: crash, out of memory, or "
                "killed); see its log above for the cause, then build a new engine"
            )
        return EngineDiedError(f"rollout engine of explorer {self.explorer_id} was closed; build a new one")

    def _check_alive(self) -> None:
        if self._closed:
            raise self._died_error()
        if self._dead is None:
            # vLLM notices a dead EngineCore asynchronously and never a dead worker: look first.
            dead = self._procs.first_dead()
            if dead is not None:
                self._engine_died(dead)
        if self._dead is not None:
            raise self._died_error()

    def _engine_died(self, which: str) -> None:
        """Record the death (first cause wins) and fail every call pending inside vLLM."""
        if self._dead is None:
            self._dead = which
            log.warning("explorer %d: vLLM engine process %s; failing its pending calls", self.explorer_id, which)
        wake_pending_calls(self._client)

    def _raise_if_dead(self, e: BaseException) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(e, EngineDeadError):
            if getattr(self, "_dead", None) is None and not getattr(self, "_closed", False):
                self._dead = "its EngineCore reported itself dead"
            raise self._died_error() from e

    def close(self) -> None:
        """Stop the engine processes; idempotent, bounded, and never waits for a call in flight.

        A call blocked in this engine (on another thread) fails with EngineDiedError.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        client = self._client
        # vLLM's own shutdown (SIGTERM, wait, SIGKILL, close sockets) in a helper thread: on a
        # wedged client it can block, and close() must return.
        stopper = threading.Thread(target=self._shutdown, daemon=True, name=f"rft-engine-close-{self.explorer_id}")
        stopper.start()
        stopper.join(_SHUTDOWN_S)
        self._procs.kill(_KILL_WAIT_S)  # whatever survived, workers of a dead EngineCore included
        wake_pending_calls(client)
        self._llm = None
        if self._adapter_dir is not None:
            import shutil

            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    def __enter__(self) -> VLLMRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_prompts(prompts: list[list[int]], n: int, max_model_len: int) -> None:
    if n < 1:
        raise UserError(f"generate: n = {n}; ask for at least one sample per prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise UserError(f"prompt {i} is empty; a prompt needs at least one token")
        if len(p) >= max_model_len:
            raise UserError(
                f"prompt {i} has {len(p)} tokens, which leaves no room for a response within "
                f"model.max_model_len = {max_model_len}; shorten the prompt or raise model.max_model_len"
            )


def sampling_fields(
    sampling: SamplingConfig, n: int, seed: int, max_tokens: int, repeat: tuple[int, int] | None
) -> dict[str, Any]:
    """vLLM SamplingParams fields of one request: n samples seeded seed, seed + 1, ... (vLLM's rule).
    Every field vLLM's server would otherwise take from the model's generation_config.json is set,
    so a served engine (rl_engine.rollout.server) samples exactly what a local one does."""
    return dict(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),  # vLLM: 0 disables top-k
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=max_tokens,
        stop=list(sampling.stop) or None,
        logprobs=0,  # only the sampled token's logprob
        detokenize=bool(
            sampling.stop
        ),  # text decoded once from the ids, unless stop strings need vLLM's incremental text
        seed=seed,
        repetition_detection={"max_pattern_size": repeat[0], "min_pattern_size": 1, "min_count": repeat[1]}
        if repeat
        else None,
    )


def request_fields(
    num_prompts: int,
    n: int,
    sampling: SamplingConfig,
    seed: int,
    max_tokens: Sequence[int] | None = None,
    repeat: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """`sampling_fields` of each prompt of a `generate` call: its own seed (`request_seeds`) and
    budget (`max_tokens[i]`, else `sampling.max_tokens`); local and served engines both use it."""
    budgets = list(max_tokens) if max_tokens is not None else [sampling.max_tokens] * num_prompts
    return [sampling_fields(sampling, n, s, b, repeat) for s, b in zip(request_seeds(seed, num_prompts, n), budgets)]


def _sampling_params(fields: dict[str, Any]) -> Any:
    """The local engine's vLLM SamplingParams of one request's `sampling_fields`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RepetitionDetectionParams

    fields = dict(fields)
    detect = fields.pop("repetition_detection")
    # Per token, vLLM's front end would build a dict per logprob: flat lists instead.
    return SamplingParams(
        **fields, flat_logprobs=True, repetition_detection=RepetitionDetectionParams(**detect) if detect else None
    )


def _sampled_logprobs(ids: list[int], lp: Any) -> list[float]:
    """The sampled token's logprob at every position, from vLLM's FlatLogprobs (`flat_logprobs=True`)."""
    if lp is None or len(lp) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if lp is None else len(lp)} logprobs for {len(ids)} response tokens")
    # vLLM puts the sampled token first at each position (logprobs=0: the only one).
    firsts = lp.start_indices
    if [lp.token_ids[i] for i in firsts] != ids:
        raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
    return [float(lp.logprobs[i]) for i in firsts]


_FINISH_REASONS: dict[str, Literal["stop", "length", "repeat"]] = {
    "stop": "stop",
    "length": "length",
    "repetition": "repeat",
}


def finish_reason(reason: str | None, engine: str) -> Literal["stop", "length", "repeat"]:
    """vLLM's finish reason -> the Rollout's; anything else (abort, error) fails naming `engine`."""
    if reason not in _FINISH_REASONS:
        raise RuntimeError(
            f"{engine} finished a generation with reason {reason!r} (expected stop, length or repetition)"
        )
    return _FINISH_REASONS[reason]


def _to_rollout(prompt_ids: list[int], c: Any, version: int, tokenizer: Any = None) -> Rollout:
    """A vLLM CompletionOutput -> Rollout (logprob of the sampled token at every position);
    with `tokenizer`, the text is decoded from the ids (vLLM did not detokenize)."""
    ids = list(c.token_ids)
    logprobs = _sampled_logprobs(ids, c.logprobs)
    reason = finish_reason(c.finish_reason, "vLLM")
    text = c.text if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)
    return Rollout(
        prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs, finish_reason=reason, version=version, text=text
    )


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def _lora_rank(rank: int) -> int:
    """vLLM's smallest max_lora_rank that holds adapters of `rank` (model.lora.rank is at most 512)."""
    return next(r for r in _LORA_RANKS if r >= rank)


def build_rollout_engine(cfg: RFTConfig, explorer_id: int = 0, cuda_visible: str | None = None) -> RolloutEngine:
    """The rollout engine of explorer `explorer_id`, from `cfg.model` and `cfg.explorer.engine`; on
    GPU its processes see the devices `cuda_visible` lists (a CUDA_VISIBLE_DEVICES value, from the
    run's device plan), else this process's."""
    m = cfg.model
    require_model_dir(m.path, "model.path")
    tok = m.tokenizer_path or m.path
    require_model_dir(tok, "model.tokenizer_path", config=False)  # a tokenizer needs no config.json
    return VLLMRolloutEngine(
        model_path=m.path,
        tokenizer_path=tok,
        dtype=m.dtype,
        max_model_len=m.max_model_len,
        engine=cfg.explorer.engine,
        seed=cfg.seed + explorer_id,
        explorer_id=explorer_id,
        cuda_visible=cuda_visible,
        lora=synced_adapter(m.lora),
    )
