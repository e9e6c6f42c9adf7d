"""A rollout engine that stays up between runs: vLLM's own server, and the explorer's client of it.

Starting a vLLM engine costs ~12 s on 2 CPU cores (it spawns a worker process, which imports
torch and vLLM again, and vLLM's set-up runs in both; the model itself loads in
milliseconds). Runs that start often (scheduled retraining, API-triggered runs of a lineage) can
skip it: keep an engine server up and point the runs' explorers at it.

    rft engine serve configs/synchronous.yaml --port 8100        # once; stays up
    rft run configs/synchronous.yaml --set 'explorer.engine.servers=["http://127.0.0.1:8100"]'

The server is vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`)
started with what a local engine of the same config gets (`serve_command`): model, dtype,
max_model_len, eager mode, KV cache, whole prefills on CPU, the seed, the RFT worker extension and
processed logprobs; plus vLLM's token-in/token-out endpoint `/inference/v1/generate`
(`--enable-scale-out`) and its dev endpoints (`VLLM_SERVER_DEV_MODE=1`), whose `/collective_rpc`
reaches the worker extension: weight syncs work on a served engine exactly as on a local one. It
binds 127.0.0.1 unless told otherwise: `/collective_rpc` runs worker methods for any caller, so
the port must never be reachable from outside the host.

`ServerRolloutEngine` is the explorer's side, the `RolloutEngine` protocol over HTTP:

* `generate` sends one request per prompt, all at once (vLLM batches them), each carrying the
  sampling fields a local engine uses (`sampling_fields`, the same per-prompt seeds, every field
  the server would default from generation_config.json set): on the same weights a served engine
  samples what a local one does, token for token. The client imports no vLLM (seconds saved).
* one run at a time: the explorer claims the server with its run id (`rft_claim` on the worker
  extension) and renews the claim every `CLAIM_TTL_S / 4` s from a thread; another owner's claim
  is refused (`EngineBusyError`, naming the holder) until its holder releases it or stops renewing
  for `CLAIM_TTL_S` s (a killed explorer).
* the explorer then loads the run's base model (version 0, from `model.path`), which also checks
  that the served model has the run's architecture.
* checkpoint sync fetches a version to a local directory and the server loads it from there: the
  server must run on the explorer's host (or see the same path). The collective method connects
  the server's worker to the trainer's group directly.
* a server that stops answering fails the call with `EngineDiedError` within its timeout.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl_engine.config import RFTConfig, SamplingConfig
from rl_engine.errors import UserError
from rl_engine.rollout.engine import (
    _CPU_TOKEN_BUDGET,
    _GIB,
    WORKER_EXTENSION,
    EngineDiedError,
    Rollout,
    _check_prompts,
    finish_reason,
    request_fields,
    sampling_fields,
)

log = logging.getLogger(__name__)

CLAIM_TTL_S = 60.0
_CONNECT_S = 10.0  # how long a request may take to connect before the server counts as gone
_GENERATE_S = 1800.0  # a generate call's read timeout (a long batch on a slow CPU)


class EngineBusyError(UserError):
    """Another run holds the engine server."""


def serve_command(
    cfg: RFTConfig, host: str = "127.0.0.1", port: int = 8100, explorer_id: int = 0
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment changes) of the vLLM server for explorer `explorer_id` of `cfg`."""
    from vllm.platforms import current_platform

    from rl_engine.rollout.engine import _cpu_thread_bind

    m, e = cfg.model, cfg.explorer.engine
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", host, "--port", str(port),
        "--model", m.path, "--tokenizer", m.tokenizer_path or m.path,
        "--dtype", m.dtype, "--max-model-len", str(m.max_model_len),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--seed", str(cfg.seed + explorer_id),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--logprobs-mode", "processed_logprobs",
        "--enable-scale-out",
    ]  # fmt: skip
    if e.enforce_eager:
        argv.append("--enforce-eager")
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if current_platform.is_cpu():  # as VLLMRolloutEngine: see its notes
        argv += [
            "--kv-cache-memory-bytes",
            str(int(e.kv_cache_space_gib * _GIB)),
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(_CPU_TOKEN_BUDGET, m.max_model_len)),
        ]
        bind = _cpu_thread_bind(e.num_threads, explorer_id)
        if bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    else:
        argv += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    return argv, env


def _server_env(changes: dict[str, str]) -> dict[str, str]:
    """This process's environment with `changes`, less VLLM_CPU_KVCACHE_SPACE: the config's size
    wins (see VLLMRolloutEngine)."""
    return {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, **changes}


def serve(cfg: RFTConfig, host: str, port: int, explorer_id: int = 0) -> int:
    """Run the engine server of `cfg`'s explorer `explorer_id` in the foreground until it is stopped."""
    import subprocess

    argv, changes = serve_command(cfg, host, port, explorer_id)
    env = _server_env(changes)
    print(
        f"engine server of explorer {explorer_id}: http://{host}:{port} ({cfg.model.path}); use it with --set 'explorer.engine.servers=[\"http://{host}:{port}\"]'",
        flush=True,
    )
    return subprocess.call(argv, env=env)


def _parse(result: Any) -> Any:
    """vLLM's /collective_rpc returns dicts and lists as they are and str() of anything else."""
    if isinstance(result, str):
        try:
            return json.loads(result)
        except ValueError:
            return result
    return result


class ServerRolloutEngine:
    """The RolloutEngine protocol over a running engine server (see the module docstring)."""

    def __init__(self, url: str, tokenizer_path: str, max_model_len: int, owner: str, explorer_id: int = 0):
        import httpx

        self.url, self.owner, self.explorer_id, self.max_model_len = url.rstrip("/"), owner, explorer_id, max_model_len
        self._version = 0
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(_GENERATE_S, connect=_CONNECT_S),
            limits=httpx.Limits(max_connections=256),
        )
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix=f"rft-server-{explorer_id}")
        try:
            served = self._get("/v1/models")["data"][0]
            if int(served.get("max_model_len") or 0) < max_model_len:
                raise UserError(
                    f"the engine server at {self.url} serves {served['id']} with max_model_len {served.get('max_model_len')}, below the run's model.max_model_len = {max_model_len}; restart it with this config (`rft engine serve CONFIG`)"
                )
            from transformers import (
                AutoTokenizer,  # vLLM's own (the local engine's) wraps the same; importing vLLM here costs seconds
            )

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            self._claim()
        except BaseException:
            self._pool.shutdown(wait=False)
            self._http.close()
            raise
        self._renewer = threading.Thread(target=self._renew, daemon=True, name=f"rft-server-claim-{explorer_id}")
        self._renewer.start()

    # ---- properties

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # ---- HTTP

    def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        import httpx

        if self._closed.is_set():
            raise EngineDiedError(
                f"rollout engine of explorer {self.explorer_id} (server {self.url}) was closed; build a new one"
            )
        try:
            r = self._http.post(
                path, json=body, **({"timeout": httpx.Timeout(timeout, connect=_CONNECT_S)} if timeout else {})
            )
        except httpx.TransportError as e:
            raise EngineDiedError(
                f"the engine server of explorer {self.explorer_id} at {self.url} does not answer ({type(e).__name__}: {e}); start it again (`rft engine serve CONFIG`) or drop explorer.engine.servers"
            ) from e
        if r.status_code != 200:
            raise RuntimeError(f"engine server {self.url}{path} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def _get(self, path: str) -> Any:
        import httpx

        try:
            r = self._http.get(path, timeout=_CONNECT_S)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise UserError(
                f"no engine server answers at {self.url} ({type(e).__name__}: {e}); start one with `rft engine serve CONFIG --port PORT`, or drop explorer.engine.servers"
            ) from e
        return r.json()

    # ---- the claim

    def _claim(self) -> None:
        [got] = self.rpc("rft_claim", self.owner, CLAIM_TTL_S, timeout=_CONNECT_S * 3)
        if not got["granted"]:
            raise EngineBusyError(
                f"the engine server at {self.url} is in use by {got['owner']} (its claim lapses {got['expires_in_s']:.0f} s after that run stops); "
                "wait for it, or start another server for this run"
            )

    def _renew(self) -> None:
        while not self._closed.wait(CLAIM_TTL_S / 4):
            try:
                self._claim()
            except Exception as e:  # noqa: BLE001 - the next call fails on its own if the server is gone
                log.warning("explorer %d: could not renew its claim on %s: %s", self.explorer_id, self.url, e)

    # ---- generation

    def _request(self, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        body = {
            "token_ids": prompt,
            "sampling_params": params,
            "output_mode": "text" if params["detokenize"] else "tokens",
        }
        return self._post("/inference/v1/generate", body)

    def _batch(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[list[Rollout]]:
        with self._lock:
            version = self._version
            outs = list(self._pool.map(self._request, prompts, params))
        return [
            [
                self._to_rollout(p, c, version, sp["detokenize"])
                for c in sorted(out["choices"], key=lambda c: c["index"])
            ]
            for p, sp, out in zip(prompts, params, outs)
        ]

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        seed: int,
        max_tokens: Sequence[int] | None = None,
        repeat: tuple[int, int] | None = None,
    ) -> list[list[Rollout]]:
        """As VLLMRolloutEngine.generate: n samples per prompt, result[i][k] sample k of prompt i."""
        _check_prompts(prompts, n, self.max_model_len)
        return (
            self._batch(prompts, request_fields(len(prompts), n, sampling, seed, max_tokens, repeat)) if prompts else []
        )

    def generate_each(self, requests: Sequence[tuple[list[int], SamplingConfig, int]]) -> list[Rollout]:
        """As VLLMRolloutEngine.generate_each: one sample per (prompt, sampling, seed)."""
        prompts = [list(p) for p, _, _ in requests]
        _check_prompts(prompts, 1, self.max_model_len)
        params = [sampling_fields(sampling, 1, seed, sampling.max_tokens, None) for _, sampling, seed in requests]
        return [group[0] for group in self._batch(prompts, params)] if prompts else []

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """As VLLMRolloutEngine.prompt_logprobs: each token's logprob given the ones before it."""
        _check_prompts(sequences, 1, self.max_model_len)
        sp = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}
        with self._lock:
            outs = list(self._pool.map(self._request, sequences, [sp] * len(sequences)))
        return [
            [float(o["prompt_logprobs"][j][str(tok)]["logprob"]) for j, tok in enumerate(seq) if j > 0]
            for seq, o in zip(sequences, outs)
        ]

    def _to_rollout(self, prompt: list[int], c: dict[str, Any], version: int, detokenized: bool) -> Rollout:
        ids = list(c["token_ids"])
        content = (c.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise RuntimeError(
                f"engine server {self.url} returned {len(content)} logprobs for {len(ids)} response tokens"
            )
        reason = finish_reason(c["finish_reason"], f"engine server {self.url}")
        text = c["text"] if detokenized else self._tokenizer.decode(ids, skip_special_tokens=True)
        return Rollout(
            prompt_ids=prompt,
            response_ids=ids,
            logprobs=[float(x["logprob"]) for x in content],
            finish_reason=reason,
            version=version,
            text=text,
        )

    # ---- weight sync hooks

    def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        body: dict[str, Any] = {"method": method, "args": list(args)}
        if timeout is not None:
            body["timeout"] = timeout
        out = self._post("/collective_rpc", body, timeout=None if timeout is None else timeout + _CONNECT_S)
        return [_parse(r) for r in (out or {}).get("results", [])]

    def mark_synced(self, version: int) -> None:
        with self._lock:
            self._post("/reset_prefix_cache", {})  # KV of the old weights must not be reused
            self._version = version

    # ---- lifecycle

    def close(self) -> None:
        """Release the claim (the server stays up for the next run); idempotent."""
        if self._closed.is_set():
            return
        try:
            self._post("/collective_rpc", {"method": "rft_unclaim", "args": [self.owner]}, timeout=_CONNECT_S)
        except Exception as e:  # noqa: BLE001 - a gone server holds no claim
            log.info("explorer %d: releasing %s: %s", self.explorer_id, self.url, e)
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def build_server_engine(cfg: RFTConfig, explorer_id: int, owner: str | None = None) -> ServerRolloutEngine:
    """Explorer `explorer_id`'s client of `cfg.explorer.engine.servers[explorer_id]`, claimed for `owner`."""
    m = cfg.model
    return ServerRolloutEngine(
        cfg.explorer.engine.servers[explorer_id],
        m.tokenizer_path or m.path,
        m.max_model_len,
        owner or f"rft-{uuid.uuid4().hex[:8]}",
        explorer_id,
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m rl_engine.rollout.server SETTINGS PORT`: this process becomes the vLLM server
    (exec: stopping it stops the server) of a model on loopback, with an explorer engine's settings:
    SETTINGS is JSON {path, max_model_len, kv_cache_space_gib}. How a judge with a model directory
    of its own is served (rl_engine.rewards.judge); the reward service that starts it owns it."""
    settings, port = argv or sys.argv[1:]
    s = json.loads(settings)
    cfg = RFTConfig.model_validate(
        {
            "model": {"path": s["path"], "max_model_len": s["max_model_len"]},
            "taskset": {"path": "unused.jsonl"},  # not read: the engine's settings are all that is used
            "explorer": {"engine": {"kv_cache_space_gib": s["kv_cache_space_gib"]}},
        }
    )
    command, changes = serve_command(cfg, "127.0.0.1", int(port))
    os.execve(command[0], command, _server_env(changes))


if __name__ == "__main__":
    main()
