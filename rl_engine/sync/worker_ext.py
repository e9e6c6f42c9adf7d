"""vLLM worker extension: the methods weight syncs call on every inference worker.

vLLM mixes this class into its worker class (`worker_extension_cls`, set by
`rl_engine.rollout.engine`); explorers reach the methods through `engine.rpc(name, ...)`
(`LLM.collective_rpc`). Methods are prefixed `rft_` so they never clash with vLLM's own.

Loading into a live engine: on CPU vLLM post-processes weights after loading (kernel formats),
so a bare `model.load_weights` fails; every load runs inside `initialize_layerwise_reload` /
`finalize_layerwise_reload` under `set_current_vllm_config`, which re-creates the checkpoint-
format parameters, loads, re-processes and copies into the kernel tensors in place.

Owner watch: vLLM's EngineCore and worker processes outlive a frontend that is SIGKILLed (they
are re-parented and keep their memory). The engine's owner passes its PID in
`RFT_ENGINE_OWNER_PID` while it starts the engine (`rl_engine.rollout.engine`); vLLM imports
this module in every worker process, and importing it there starts a daemon thread
(`rl_engine.proc.owner_watch`) that, once the owner is gone, kills the processes between this worker
and the owner (the EngineCore) and then exits the worker.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rl_engine.adapter import ENGINE_ADAPTER_ID as ADAPTER_ID
from rl_engine.adapter import MODEL_SUBDIR, is_adapter_tensor
from rl_engine.proc.owner_watch import start_owner_watch


def _read_dir(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(directory).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _refresh_tied_lm_heads(model: torch.nn.Module) -> None:
    """Re-run weight processing of an lm_head tied to the input embeddings.

    The checkpoint has no `lm_head.weight` for a tied model, so the layerwise reload loads
    nothing into the head and keeps its old kernel state; on CPU that state is a packed GEMM
    handle built from the old embedding. The head shares the (now updated) embedding
    Parameter, so processing it again rebuilds the handle from the new values.
    """
    for m in _tied_lm_heads(model):
        m.quant_method.process_weights_after_loading(m)


def _tied_lm_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's lm_heads that share their weight with an input embedding (tie_word_embeddings)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeds = {m.weight.data_ptr() for m in model.modules() if type(m) is VocabParallelEmbedding}
    return [m for m in model.modules() if isinstance(m, ParallelLMHead) and m.weight.data_ptr() in embeds]


class _ExpectedNotLoaded(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" warning of a reload for layers that have no
    weights in a checkpoint by design, and which the reload leaves right: rotary embeddings (their
    cos/sin cache is computed from the config, and kept) and, when `tied_head`, the lm_head (a tied
    model's checkpoint has no `lm_head.weight`; `_refresh_tied_lm_heads` rebuilds the head from the
    loaded embedding right after). It came at every weight sync and read like a failure. Any other
    layer's warning still comes through."""

    def __init__(self, tied_head: bool):
        super().__init__()
        self.tied_head = tied_head

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or (self.tied_head and layer == "ParallelLMHead"))


class RFTWorkerExtension:
    """Mixed into vLLM's worker; `self` is the worker (model_runner, vllm_config, rank, device)."""

    # ---- in-place loading

    @contextlib.contextmanager
    def _rft_reloading(self) -> Iterator[Any]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
            layerwise,
        )

        model = self.model_runner.get_model()
        notice, quiet = logging.getLogger(layerwise.__name__), _ExpectedNotLoaded(tied_head=bool(_tied_lm_heads(model)))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            try:
                yield model
            finally:
                notice.addFilter(quiet)
                try:
                    finalize_layerwise_reload(model, self.model_config)
                finally:
                    notice.removeFilter(quiet)
            _refresh_tied_lm_heads(model)

    def _rft_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format (HF-named) weights in place; returns how many tensors were loaded.
        An engine serving a LoRA policy (`rft_adapter_init`) takes an adapter's tensors (installed
        in its one slot) or the base model's (reloaded, and the zero adapter installed: version 0)."""
        if self._rft_serves_adapter():
            tensors = dict(weights)
            if any(is_adapter_tensor(k) for k in tensors):
                return self._rft_install_adapter(tensors)
            n = self._rft_load_base(tensors.items())
            self._rft_install_adapter(_read_dir(self._rft_zero_dir))
            return n
        return self._rft_load_base(weights)

    def _rft_load_base(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        n = 0

        def counted():
            nonlocal n
            for item in weights:
                n += 1
                yield item

        with self._rft_reloading() as model:
            model.load_weights(counted())
        return n

    # ---- LoRA: the base model served, the policy's adapter installed in place

    def _rft_serves_adapter(self) -> bool:
        return getattr(self, "_rft_peft", None) is not None

    def rft_adapter_init(self, peft: dict[str, Any], zero_dir: str) -> int:
        """Serve a LoRA policy: adapters have config `peft` (its adapter_config.json); install the
        zero adapter in `zero_dir` (version 0: the base model's outputs). Returns tensors installed."""
        self._rft_peft, self._rft_zero_dir = peft, zero_dir
        return self._rft_install_adapter(_read_dir(zero_dir))

    def _rft_install_adapter(self, tensors: dict[str, torch.Tensor]) -> int:
        """Replace the adapter in the engine's one LoRA slot by `tensors` (peft file names): the
        previous version's adapter is dropped, the new one copied into the same slot's buffers, so
        engine memory does not grow with versions; the requests keep naming adapter `ADAPTER_ID`."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
        manager = workers._adapter_manager
        helper = PEFTHelper.from_dict(dict(self._rft_peft))
        helper.validate_legal(workers.lora_config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            ADAPTER_ID,
            {k: v.clone() for k, v in tensors.items()},  # received tensors may live in reused buffers
            helper,
            device="cpu",
            dtype=workers.lora_config.lora_dtype,
            model_vocab_size=workers.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        if not adapter.loras:
            raise ValueError(f"none of the {len(tensors)} tensors is an adapter of this model's LoRA modules")
        manager.remove_adapter(ADAPTER_ID)
        manager.add_adapter(adapter)
        manager.activate_adapter(ADAPTER_ID)
        return len(tensors)

    def rft_adapter_probe(self) -> dict[str, Any]:
        """Test probe: the adapters this worker holds (ids), its LoRA slots, the float64 sum of
        every slot buffer (the same after a version's install as before it, when the version's
        values are: nothing accumulates across installs), and how many adapter objects are alive
        (one: an install that left the last version's behind would leak a copy per version)."""
        import gc

        from vllm.lora.lora_model import LoRAModel

        manager = self.model_runner.lora_manager._adapter_manager
        slots = 0.0
        for module in manager.modules.values():
            for t in (*getattr(module, "lora_a_stacked", ()), *getattr(module, "lora_b_stacked", ())):
                slots += float(t.double().abs().sum())
        return {
            "adapters": sorted(manager.list_adapters()),
            "slots": list(manager.lora_index_to_id),
            "slot_abs_sum": slots,
            "adapter_objects": (gc.collect(), sum(isinstance(o, LoRAModel) for o in gc.get_objects()))[1],
        }

    # ---- collective method

    def rft_join_group(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        shm_path: str | None = None,
    ) -> int:
        """Join the weight-sync group as rank `rank_offset + worker rank`; blocks until the group is
        complete. `shm_path`: the trainer's shared-memory file (rl_engine.sync.shm), mapped if this
        worker can open it; the group uses it only if every member could."""
        from rl_engine.sync.buckets import join_group
        from rl_engine.sync.shm import SharedRegion

        self.rft_leave_group()
        rank = rank_offset + self.rank
        region = SharedRegion.attach(shm_path) if shm_path and backend == "gloo" else None
        self._rft_pg, self._rft_region = join_group(host, port, rank, world_size, backend, timeout_s, region=region)
        self._rft_backend = backend
        return rank

    def rft_leave_group(self) -> None:
        from rl_engine.sync.buckets import destroy_group

        region = getattr(self, "_rft_region", None)
        if region is not None:
            self._rft_region = None
            region.close()
        pg = getattr(self, "_rft_pg", None)
        if pg is not None:
            self._rft_pg = None
            with contextlib.suppress(Exception):
                destroy_group(pg)

    def _rft_group(self) -> tuple[Any, torch.device]:
        pg = getattr(self, "_rft_pg", None)
        if pg is None:
            raise RuntimeError("this worker has not joined a weight-sync group; call connect() on the receiver first")
        device = self.device if self._rft_backend == "nccl" else torch.device("cpu")
        return pg, device

    def rft_receive_broadcast(self) -> tuple[int, int]:
        """Receive one broadcast weight stream and load it in place; returns (version, tensors loaded)."""
        from rl_engine.sync.buckets import ReceiveBuffers, broadcast_recv

        pg, device = self._rft_group()
        if getattr(self, "_rft_buffers", None) is None:
            self._rft_buffers = ReceiveBuffers(device, reuse=device.type == "cpu")
        try:
            if self._rft_serves_adapter():  # an adapter: gathered, then installed (which copies it)
                got: list[tuple[str, torch.Tensor]] = []
                version, n = broadcast_recv(pg, device, got.extend, region=self._rft_region)
                self._rft_load(got)
            else:
                with self._rft_reloading() as model:
                    version, n = broadcast_recv(pg, device, model.load_weights, self._rft_buffers, self._rft_region)
        except BaseException as e:
            # A broken broadcast leaves the group unusable. Closing it now (with the frames that hold
            # its pending works cleared) makes the other ranks' sockets close: they fail at once
            # instead of waiting out collective.timeout_s.
            del pg
            traceback.clear_frames(e.__traceback__)
            self.rft_leave_group()
            raise
        self._rft_version = version
        return version, n

    def rft_raw_receive(self, sizes: list[int]) -> None:
        """Benchmark floor: receive plain broadcasts of these byte sizes into reused buffers, load nothing."""
        from rl_engine.sync.buckets import raw_broadcast

        pg, device = self._rft_group()
        key = (tuple(sizes), str(device))
        if getattr(self, "_rft_raw_key", None) != key:
            self._rft_raw_key, self._rft_raw_bufs = (
                key,
                [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes],
            )
        raw_broadcast(pg, self._rft_raw_bufs)

    # ---- checkpoint method

    def rft_load_checkpoint(self, local_dir: str, version: int) -> tuple[int, int]:
        """Load every *.safetensors file of a local checkpoint directory in place; returns (version, tensors)."""
        from safetensors import safe_open

        if self._rft_serves_adapter() and (Path(local_dir) / MODEL_SUBDIR).is_dir():
            # a LoRA run's saved model: its adapter beside the merged weights
            local_dir = str(Path(local_dir) / MODEL_SUBDIR)
        files = sorted(Path(local_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {local_dir}")
        with contextlib.ExitStack() as opened:
            # Every shard is opened (header checked, file held) before the reload starts: a file that
            # is missing or unreadable fails here with the live weights untouched, and one deleted
            # later (retention) is still read whole.
            shards = [opened.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files]

            def weights():
                for sf in shards:
                    for name in sf.keys():
                        yield name, sf.get_tensor(name)

            n = self._rft_load(weights())
        self._rft_version = version
        return version, n

    def rft_profile_reload(self, local_dir: str) -> dict[str, float]:
        """Benchmark: where an in-place reload spends its time (`bench.sync`).

        Reads a checkpoint directory into memory (so no file I/O is measured), reloads it once
        timed and once under cProfile. Returns seconds: `reload` (the timed reload), and from the
        profiled one `pack` (vLLM's CPU kernel format: the oneDNN GEMM handles it builds per
        linear layer; 0 on GPU) and `copy` (tensor copies: into the checkpoint-format layer,
        then into the kernel tensors). The rest of `reload` is the layerwise bookkeeping.
        The engine's version is left as it was: bench.sync passes the weights it already holds.
        """
        import cProfile
        import pstats
        import time

        from safetensors.torch import load_file

        weights = [
            (k, v.clone()) for f in sorted(Path(local_dir).glob("*.safetensors")) for k, v in load_file(str(f)).items()
        ]
        t0 = time.perf_counter()
        self._rft_load(iter(weights))
        reload_s = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.runcall(self._rft_load, iter(weights))
        stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, prim calls, own s, cumulative s, callers)

        def own_s(name: str) -> float:
            return sum(st[2] for (_, _, n), st in stats.items() if n == name)

        return {
            "reload": reload_s,
            "pack": own_s("<built-in method torch._ops._C.create_onednn_mm_handler>"),
            "copy": own_s("<method 'copy_' of 'torch._C.TensorBase' objects>"),
        }

    def rft_weight_probe(self, names: list[str], rows: list[int]) -> dict[str, Any]:
        """Test and debugging probe: what this worker's model holds, by vLLM parameter name.

        For each name in `names`: its shape, float64 sum, and the `rows` of its first dimension
        (float32, as nested lists: RPC results travel as plain data). `tied` says whether `lm_head.weight` is the very tensor of
        `model.embed_tokens.weight` (vLLM ties them for tie_word_embeddings), `lm_head_equal`
        whether their values are equal (None where the model has no such pair).
        """
        model = self.model_runner.get_model()
        params = dict(model.named_parameters(remove_duplicate=False))
        out: dict[str, Any] = {}
        with torch.no_grad():
            for name in names:
                p = params.get(name)
                if p is None:
                    raise KeyError(f"no parameter {name!r} in the vLLM model; it has {sorted(params)[:8]}...")
                out[name] = {
                    "shape": tuple(p.shape),
                    "sum": float(p.double().sum()),
                    "rows": p[list(rows)].float().cpu().tolist(),
                }
            head, embed = params.get("lm_head.weight"), params.get("model.embed_tokens.weight")
            if head is None or embed is None:
                out["tied"] = out["lm_head_equal"] = None
            else:
                out["tied"] = head is embed or (head.data_ptr() == embed.data_ptr() and head.shape == embed.shape)
                out["lm_head_equal"] = head.shape == embed.shape and bool(torch.equal(head, embed))
        return out

    def rft_version(self) -> int:
        """Version of the weights this worker holds (0 until a sync)."""
        return getattr(self, "_rft_version", 0)

    # ---- claims: an engine server serves one run at a time (rl_engine.rollout.server)

    def rft_claim(self, owner: str, ttl_s: float) -> dict[str, Any]:
        """Claim this worker for `owner` for `ttl_s` s (or renew its claim); refused while another owner's claim lasts."""
        now = time.monotonic()
        held = getattr(self, "_rft_claim", None)
        if held is not None and held[0] != owner and held[1] > now:
            return {"granted": False, "owner": held[0], "expires_in_s": held[1] - now}
        self._rft_claim = (owner, now + float(ttl_s))
        return {"granted": True, "owner": owner, "expires_in_s": float(ttl_s)}

    def rft_unclaim(self, owner: str) -> bool:
        """Drop `owner`'s claim (another owner's stays); whether one was dropped."""
        held = getattr(self, "_rft_claim", None)
        if held is None or held[0] != owner:
            return False
        self._rft_claim = None
        return True


# vLLM imports this module in each worker process (it resolves `worker_extension_cls` there) and
# never calls an __init__ of the extension, so import time is the one hook it leaves us.
start_owner_watch()
