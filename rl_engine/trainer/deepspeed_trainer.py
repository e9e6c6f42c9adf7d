"""The DeepSpeed trainer: a Hugging Face causal LM in a DeepSpeed engine, trained with GRPO or SFT.

CPU (laptop, CI): DeepSpeed's CPU accelerator with gloo; GPU: CUDA with NCCL. ZeRO stage
`trainer.zero_stage` is passed through on both (0, 2 and 3 are tested on CPU, world size 1:
same first step, resume and save_hf; 0 and 2 on 2 ranks: 1 rank's update, exact resume; 0 is
the cheapest there). The optimizer is torch's AdamW (works with every accelerator; DeepSpeed's
ZeRO wraps it), the LR schedule a linear warmup (`torch.optim.lr_scheduler.LambdaLR`: step 1
already trains at lr / warmup_steps, where DeepSpeed's WarmupLR spends its first steps at lr 0).

One `train_step` = one optimizer update = one policy version. The batch (`[B, L]` tensors of
`ExperienceBatch.to_tensors`, B = train_batch_size / world size on this rank) is cut into
micro-batches of `trainer.micro_batch_size` rows, bucketed by length (rl_engine.trainer.buckets:
each runs only up to its longest row); each micro-loss is normalised by the token and
sequence counts of the *whole* batch, over all ranks, and backpropagated unscaled, so
accumulation and data-parallel ranks give the same update as one big batch. Advantages: `batch["advantages"] [B]` if the caller put them
there, else GRPO advantages from `rewards` and `group_index` (`rl_engine.algorithms`); with
several data-parallel ranks each rank's share must then hold whole groups (or pass advantages).

    trainer = build_trainer(trainer_settings(cfg))    # rl_engine.trainer
    metrics = trainer.train_step(batch.to_tensors(trainer.pad_token_id))
    trainer.save_hf("runs/x/checkpoints/version=3")

Tests: `.venv/bin/python -m pytest tests/rl_engine/trainer -m "slow or not slow"`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rl_engine.adapter import synced_adapter
from rl_engine.algorithms import policy_loss, prepare_batch_rows, row_metrics, sft_loss, token_sum_divisor, version_mask
from rl_engine.errors import UserError
from rl_engine.model_dir import require_model_dir
from rl_engine.proc.starts import count_start
from rl_engine.trainer import buckets, lora
from rl_engine.trainer import checkpoint as ckpt
from rl_engine.trainer.dist import accelerator_device, ensure_dist_env, preload_deepspeed_ops
from rl_engine.trainer.head import LOGITS_CHUNK_TOKENS, head_logprobs, plain_lm_head
from rl_engine.trainer.prefix import can_share_prompts, share_plan
from rl_engine.trainer.settings import TrainerSettings

Batch = dict[str, Tensor]
# (micro-batch, its trained-token mask [b, L], whole-batch token/sequence counts) -> (loss, metric sums)
MicroLoss = Callable[[Batch, Tensor, dict[str, float]], tuple[Tensor, dict[str, float]]]


class DeepSpeedTrainer:
    """See the module docstring. `version` = completed trainer steps (0 = the initial weights).
    Takes `TrainerSettings` (rl_engine.trainer.settings), not the run's config."""

    def __init__(self, settings: TrainerSettings):
        from transformers import AutoTokenizer

        self.settings = s = settings
        self.algo = s.algorithm
        self.max_response_tokens = s.max_response_tokens
        self.token_sum_divisor = float(token_sum_divisor(s.algorithm, s.max_response_tokens))
        self.temperature = s.temperature
        self.version = 0
        if s.num_threads:
            torch.set_num_threads(s.num_threads)
        torch.manual_seed(s.seed)
        model_dir = require_model_dir(s.model_path)
        tok_dir = (
            str(Path(s.tokenizer_path).expanduser()) if s.tokenizer_path else model_dir
        )  # a tokenizer needs no config.json
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        if self.tokenizer.pad_token_id is None:
            raise UserError(
                f"tokenizer in {tok_dir} has no pad token; batches are right-padded with it. "
                "Set one (e.g. tokenizer.pad_token = tokenizer.eos_token; tokenizer.save_pretrained(dir)) or use a tokenizer that has one"
            )
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        ensure_dist_env(s.local_device)
        self.device = accelerator_device()
        self.engine = self._build_engine(model_dir)
        self.rank = int(self.engine.global_rank)
        self.world = int(self.engine.world_size)
        self.micro_batch_size = int(self.engine.train_micro_batch_size_per_gpu())
        self.local_batch_size = self.micro_batch_size * int(self.engine.gradient_accumulation_steps())
        # LoRA: the reference is the base itself, the adapter disabled (`_reference_logprobs`), no second copy
        self.reference = (
            _load_reference(model_dir, s.dtype, self.device) if self.algo.kl is not None and s.lora is None else None
        )
        # None: full [b, L, V] logits (models not known to be lm_head(hidden); tests compare the two)
        self.logits_chunk_tokens: int | None = LOGITS_CHUNK_TOKENS if plain_lm_head(self.engine.module) else None
        # a group's prompt once per micro-batch (rl_engine.trainer.prefix): the chunked head's path only
        self.share_prompts = s.share_prompts and can_share_prompts(self.engine.module, s.zero_stage, self.world)

    # ---------------------------------------------------------------- setup

    def _build_engine(self, model_dir: str):
        import deepspeed

        s = self.settings
        tbs, micro = s.train_batch_size, s.micro_batch_size
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if tbs % (micro * world):
            raise UserError(
                f"trainer.train_batch_size = {tbs} must be a multiple of trainer.micro_batch_size = {micro} x world size {world}; "
                f"pick a micro_batch_size that divides {tbs // world if tbs % world == 0 else tbs}"
            )
        model = _load_model(model_dir, s.dtype)
        if s.lora is not None:  # ZeRO-3 with LoRA is refused by the config (RFTConfig._lora_fits_zero)
            model = lora.wrap(model, s.lora)  # before DeepSpeed: it sees the adapters as the only trainable parameters
        trainable = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel over all tensors (on 2 CPU cores 0.15 s a step for SmolLM2-135M, against
        # 0.7 s for the per-tensor loop); the same update to fp32 rounding, and transformers' default
        optimizer = torch.optim.AdamW(trainable, lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay, fused=True)
        warmup = s.warmup_steps
        # LambdaLR gets the number of finished steps n: step n+1 trains at lr * min(1, (n+1) / warmup).
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0
        )
        ds_config: dict[str, Any] = {
            "train_batch_size": tbs,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": tbs // (micro * world),
            "gradient_clipping": s.grad_clip,
            "zero_optimization": {"stage": s.zero_stage},
            "bf16": {"enabled": s.dtype == "bfloat16"},
            "fp16": {"enabled": s.dtype == "float16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,  # our own metrics; keep DeepSpeed's progress lines out of the logs
            "wall_clock_breakdown": False,
        }
        preload_deepspeed_ops()  # a build lock left by a killed trainer would hang initialize forever
        count_start("deepspeed_init")
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        return engine

    # ---------------------------------------------------------------- steps

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One policy update on this rank's share of a trainer batch; returns its metrics.

        Metrics: loss, pg_loss, kl (to the reference; when algorithm.kl is set), approx_kl (k3,
        current vs proximal logprobs), entropy, clip_frac (tokens whose gradient the loss's clip
        removed or bounded), grad_norm (before clipping), lr, tokens (trained),
        masked_stale_tokens, logprob_diff (mean |current - behavior|, the trainer/explorer
        mismatch), version (after the step); with an off-policy correction offpolicy_clamped_frac,
        offpolicy_masked_frac, is_weight_mean; filtered_experiences (dynamic sampling),
        truncated_masked, overlong_penalty when those knobs are on.
        """
        b = self._to_device(
            batch,
            required=(
                "input_ids",
                "attention_mask",
                "loss_mask",
                "behavior_logprobs",
                "versions",
                "rewards",
                "group_index",
                "response_len",
                "truncated",
            ),
        )
        extra: dict[str, float] = {}
        if "advantages" not in b:  # one rank: the whole batch is here (TrainerRanks prepares both for several)
            prep = prepare_batch_rows(b, self.algo, self.max_response_tokens)
            b["advantages"], b["trained_rows"] = (
                prep.advantages.to(self.device),
                prep.trained_rows.to(self.device),
            )  # [B] x 2
            extra = row_metrics(prep, self.algo)
        stale = version_mask(b["versions"], self.version, self.algo.max_version_gap)  # [B, L]
        b["mask"] = b["loss_mask"] * stale * b["trained_rows"].unsqueeze(-1)  # [B, L]
        if self.algo.proximal == "recompute":
            b["old_logprobs"] = self.compute_logprobs(b).to(self.device)  # [B, L], before the update
        else:
            b["old_logprobs"] = b["behavior_logprobs"].float()
        if self.algo.kl is not None:
            b["ref_logprobs"] = self._reference_logprobs(b)  # [B, L]
        metrics = self._run_step(b, self._policy_micro_loss)
        metrics["masked_stale_tokens"] = float((b["loss_mask"] * (1 - stale)).sum())
        return {**metrics, **extra}

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One supervised update: mean negative log-likelihood of the `loss_mask` tokens."""
        b = self._to_device(batch, required=("input_ids", "attention_mask", "loss_mask"))
        b["mask"] = b["loss_mask"].float()
        return self._run_step(b, self._sft_micro_loss)

    def _run_step(self, b: Batch, micro_loss: MicroLoss) -> dict[str, float]:
        """Forward/backward every micro-batch, then one optimizer step (DeepSpeed applies it at
        the accumulation boundary, after the last micro-batch)."""
        n = b["input_ids"].shape[0]
        if n != self.local_batch_size:
            raise ValueError(
                f"train batch has {n} rows; this rank trains {self.local_batch_size} per step (train_batch_size / world size)"
            )
        mask = b["mask"]
        (positions, attended), mbs = self._micro_batches(b)
        counts = self._batch_counts(mask, positions, attended)
        sums: dict[str, float] = {}
        grad_norm = float("nan")
        lr = float(self.engine.get_lr()[0])  # the rate this step uses (the scheduler moves it after)
        self.engine.train()
        for i, part in enumerate(mbs):
            mb = buckets.take(b, part)
            loss, parts = micro_loss(mb, mb["mask"], counts)
            # Unscaled: the micro-losses already sum to the batch loss (whole-batch counts).
            self.engine.backward(loss, scale_wrt_gas=False)
            for k, v in {"loss": float(loss.detach()), **parts}.items():
                sums[k] = sums.get(k, 0.0) + v
            if i == len(mbs) - 1 and not _zero_managed_any(self.engine.module):
                grad_norm = _grad_norm(self.engine.module)  # stage 0: DeepSpeed does not report it
            self.engine.step()
        if _zero_managed_any(self.engine.module):
            norm = self.engine.get_global_grad_norm()  # None when ZeRO did not compute one
            grad_norm = float("nan") if norm is None else float(norm)
        self.version += 1
        sums = self._summed_over_ranks(sums)
        tokens = max(counts["tokens"] * self.world, 1.0)
        out = {
            "loss": sums.pop("loss"),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": counts["tokens"] * self.world,
            # the batch as the decoder runs it, whole batch: positions (rows x padded length, a shared
            # prompt once) and the real tokens among them: padding's share of the step's compute
            "positions": counts["positions"] * self.world,
            "attended": counts["attended"] * self.world,
            "version": float(self.version),
        }
        for k in ("pg_loss", "kl"):
            if k in sums:
                out[k] = sums.pop(k)
        out.update({k: v / tokens for k, v in sums.items()})  # per-token means of the token sums
        for k in ("clipped", "offpolicy_clamped", "offpolicy_masked", "is_weight"):  # token sums -> per-token means
            if k in out:
                out[{"clipped": "clip_frac", "is_weight": "is_weight_mean"}.get(k, k + "_frac")] = out.pop(k)
        return out

    def _micro_batches(self, b: Batch) -> tuple[tuple[int, int], list[buckets.MicroBatch]]:
        """The step's micro-batches, rows by length or, where the trainer shares prompts, a group's
        rows together if that runs fewer positions (it does when a group's rows share a prompt);
        with the decoder's (positions, real tokens) of them."""
        group = self._groups(b)
        by_length = buckets.micro_batches(b["attention_mask"], self.micro_batch_size)
        plans = [(self._decoder_counts(b, by_length, group), by_length)]
        if group is not None:
            by_group = buckets.micro_batches(b["attention_mask"], self.micro_batch_size, group)
            plans.append((self._decoder_counts(b, by_group, group), by_group))
        return min(plans, key=lambda plan: plan[0][0])  # the first of the fewest positions

    def _decoder_counts(self, b: Batch, mbs: list[buckets.MicroBatch], group: Tensor | None) -> tuple[int, int]:
        """(positions the decoder runs over the micro-batches, the real tokens among them): rows x
        trimmed length, or where a group's prompt runs once, that prompt once and each row's own rest."""
        positions = attended = 0
        for mb in mbs:
            am = b["attention_mask"][mb.rows, : mb.length]  # [b, l]
            plan = None if group is None else share_plan(b["input_ids"][mb.rows, : mb.length], am, group[mb.rows])
            p, a = plan.counts() if plan is not None else (buckets.positions([mb]), int(am.sum()))
            positions, attended = positions + p, attended + a
        return positions, attended

    def _batch_counts(self, mask: Tensor, positions: int, attended: int) -> dict[str, float]:
        """Trained tokens and sequences of the whole batch (all ranks) / world size: DeepSpeed
        averages the ranks' gradients, so each rank's loss sum over this gives the whole batch's
        mean, whatever each rank's share of the tokens. Also the positions the decoder runs and
        the real (non-padding) tokens among them (`_decoder_counts`), the same way (metrics only)."""
        counts = torch.stack(
            [
                mask.sum().double(),
                (mask.sum(-1) > 0).sum().double(),
                torch.tensor(float(positions), dtype=torch.float64, device=mask.device),
                torch.tensor(float(attended), dtype=torch.float64, device=mask.device),
            ]
        )  # [4]
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)  # the default group: DeepSpeed's data-parallel ranks
        tokens, seqs, positions, attended = (float(x) / self.world for x in counts.tolist())
        return {"tokens": tokens, "seqs": seqs, "positions": positions, "attended": attended}

    def _summed_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums of the whole batch. Losses were normalised per rank by counts / world
        (`_batch_counts`): their sum over ranks / world is the batch's loss."""
        if self.world == 1:
            return sums
        import torch.distributed as dist

        keys = sorted(sums)
        total = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)  # [K]
        dist.all_reduce(total)
        return {k: v / self.world if k in ("loss", "pg_loss", "kl") else v for k, v in zip(keys, total.tolist())}

    def _policy_micro_loss(self, mb: Batch, mask: Tensor, counts: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        # The head runs on trained positions only (mask > 0): the prompt is most of a short
        # response's row, and skipping it made the SmolLM2 step 20% faster (bench.real). Untrained
        # positions take the old logprobs (ratio 1); mask zeroes them in the loss anyway.
        logp, ent = self._token_logprobs(
            self.engine.module,
            self.engine,
            mb["input_ids"],
            mb["attention_mask"],
            self.temperature,
            mask,
            group=self._groups(mb),
        )  # [b, L] x 2
        logp = torch.where(mask > 0, logp, mb["old_logprobs"])  # [b, L]
        out = policy_loss(
            logp,
            mb["old_logprobs"],
            mb["advantages"],
            mask,
            self.algo,
            mb["behavior_logprobs"].float(),
            mb.get("ref_logprobs"),
            counts["tokens"],
            counts["seqs"],
            self.token_sum_divisor,
        )
        with torch.no_grad():
            log_ratio = mb["old_logprobs"] - logp.detach()  # [b, L]
            parts = {
                "pg_loss": float(out.pg_loss),
                "entropy": float((ent * mask).sum()),
                "clipped": float(out.clipped_tokens),
                **(
                    {
                        "offpolicy_clamped": float(out.clamped_tokens),
                        "offpolicy_masked": float(out.masked_tokens),
                        "is_weight": float(out.weight_sum),
                    }
                    if self.algo.correction
                    else {}
                ),
                "approx_kl": float(((log_ratio.exp() - 1 - log_ratio) * mask).sum()),
                "logprob_diff": float(((logp.detach() - mb["behavior_logprobs"]).abs() * mask).sum()),
            }
            if out.kl is not None:
                parts["kl"] = float(out.kl)
        return out.loss, parts

    def _sft_micro_loss(self, mb: Batch, mask: Tensor, counts: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        logp, ent = self._token_logprobs(
            self.engine.module, self.engine, mb["input_ids"], mb["attention_mask"], 1.0, mask
        )  # [b, L]: SFT fits the untempered model
        return sft_loss(logp, mask, counts["tokens"]), {"entropy": float((ent * mask).sum())}

    # ---------------------------------------------------------------- logprobs

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> Tensor:
        """Current policy's logprobs [B, L] (float32, on this trainer's device) of input_ids,
        aligned like `behavior_logprobs`, with logits / the sampling temperature."""
        return self._logprobs_with(self.engine.module, self.engine, batch)

    @torch.no_grad()
    def _reference_logprobs(self, batch: Batch) -> Tensor:
        """Logprobs [B, L] of the KL reference: the initial weights (a frozen copy), or under LoRA the
        base model itself with the adapter disabled."""
        if self.settings.lora is not None:
            with self.engine.module.disable_adapter():
                return self._logprobs_with(self.engine.module, self.engine, batch)
        return self._logprobs_with(self.reference, self.reference, batch)

    def _logprobs_with(self, model: torch.nn.Module, forward: Callable[..., Any], batch: Batch) -> Tensor:
        """Logprobs [B, L] of every real position (not only the trained ones: callers compare them
        with the explorer's), micro-batch by micro-batch as a step runs them (a group's prompt once where
        the trainer shares prompts); 0 past the length a row's micro-batch runs."""
        b = self._to_device(
            {k: batch[k] for k in ("input_ids", "attention_mask", "group_index") if k in batch},
            required=("input_ids", "attention_mask"),
        )
        ids, am, group = b["input_ids"], b["attention_mask"], self._groups(b)  # [B, L], [B, L], [B] or None
        if self.settings.lora is not None:
            model.eval()  # no adapter dropout in logprobs compared with the explorer's (_run_step sets train again)
        out = torch.zeros(ids.shape, dtype=torch.float32, device=self.device)  # [B, L]; 0 past each row's bucket
        for mb in self._micro_batches(b)[1]:
            out[mb.rows, : mb.length] = self._token_logprobs(
                model,
                forward,
                ids[mb.rows, : mb.length],
                am[mb.rows, : mb.length],
                self.temperature,
                None,
                entropy=False,
                group=None if group is None else group[mb.rows],
            )[0].float()  # [b, l]
        return out

    def _token_logprobs(
        self,
        model: torch.nn.Module,
        forward: Callable[..., Any],
        ids: Tensor,
        am: Tensor,
        temperature: float,
        mask: Tensor | None,
        entropy: bool = True,
        group: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(logprobs [b, L] with grad, entropy [b, L] without) of ids under `model` run by `forward`
        (rl_engine.trainer.head: chunked output head, or full logits when `logits_chunk_tokens` is None;
        `group` [b]: each group's shared prompt runs once)."""
        return head_logprobs(model, forward, ids, am, temperature, self.logits_chunk_tokens, mask, entropy, group)

    def _groups(self, b: Batch) -> Tensor | None:
        """The rows' groups [b] where the trainer runs each group's shared prompt once (policy steps)."""
        return b.get("group_index") if self.share_prompts and self.logits_chunk_tokens is not None else None

    # ---------------------------------------------------------------- weights and state

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """What a weight sync sends: (HF name, full tensor) of every parameter, gathered one at a
        time under ZeRO-3 (collective: all ranks iterate together; tied weights appear once), or
        under LoRA the adapter only (rl_engine.trainer.lora.adapter_weights: peft's file names),
        which the explorers' engines install on the base model they serve, or with `lora.sync:
        merged` the merged weights under the base model's names (merged_weights)."""
        import deepspeed

        if self.settings.lora is not None:
            by = lora.adapter_weights if synced_adapter(self.settings.lora) else lora.merged_weights
            yield from by(self.engine.module)
            return
        for name, p in self.engine.module.named_parameters():
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p]):
                    yield name, p.detach().clone()
            else:
                yield name, p.detach()

    def save_hf(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Write a Hugging Face model directory (safetensors, config.json, generation config,
        tokenizer) to `url`, loadable by transformers and vLLM. Rank 0 writes. Under LoRA the
        model is the merged one (no peft needed to load it) and `adapter/` beside it holds the
        adapter in peft's layout (adapter_model.safetensors, adapter_config.json)."""
        import tempfile

        from rl_engine.adapter import MODEL_SUBDIR
        from rl_engine.storage import join

        weights = lora.merged_weights(self.engine.module) if self.settings.lora is not None else self.named_weights()
        state = {name: t.cpu() for name, t in weights}
        if self.rank != 0:
            return
        module = self.engine.module
        with tempfile.TemporaryDirectory(prefix="rft-hf-") as tmp:
            hf = module.get_base_model() if self.settings.lora is not None else module
            hf.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            ckpt.upload_dir(tmp, url, storage_options)
            if self.settings.lora is not None:
                lora.save_adapter(module, f"{tmp}/{MODEL_SUBDIR}")
                ckpt.upload_dir(f"{tmp}/{MODEL_SUBDIR}", join(url, MODEL_SUBDIR), storage_options)

    def save_state(
        self, url: str, storage_options: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        """Write resumable state (weights, optimizer, LR schedule, RNG, version, `extra`) to `url`;
        see `rl_engine.trainer.checkpoint` for the format. `COMMITTED` is written last. Under LoRA
        the weights and optimizer state are the adapter's only (the base is model.path's)."""
        from rl_engine.storage import join, open_storage

        weights, opt_tensors, opt_meta = ckpt.collect_state(
            self.engine.module, self.engine.optimizer, trainable_only=self.settings.lora is not None
        )  # lazy: fetched while written
        rng_tensors, rng_meta = ckpt.rng_state()
        if self.rank != 0:
            ckpt.drain(weights)  # ZeRO-3's fetches are collective: take part in rank 0's, in its order
            ckpt.drain(opt_tensors)
            return
        fs, root = open_storage(url, storage_options)
        fs.makedirs(root, exist_ok=True)
        ckpt.write_tensors(fs, join(root, "model.safetensors"), weights)
        ckpt.write_tensors(fs, join(root, "optimizer.safetensors"), opt_tensors)
        ckpt.write_tensors(fs, join(root, "rng.safetensors"), rng_tensors)
        e = self.engine
        meta = {
            "format": ckpt.FORMAT,
            "format_version": ckpt.FORMAT_VERSION,
            "version": self.version,
            "engine": {
                "global_steps": e.global_steps,
                "global_samples": e.global_samples,
                "micro_steps": e.micro_steps,
                "skipped_steps": e.skipped_steps,
            },
            "optimizer": opt_meta,
            "lr_scheduler": _jsonable_scheduler_state(e.lr_scheduler),
            "rng": rng_meta,
            "lora": _adapter_shape(self.settings.lora),
            "extra": extra or {},
        }
        ckpt.write_json(fs, join(root, "state.json"), meta)
        ckpt.write_json(fs, join(root, ckpt.COMMIT_MARKER), {"version": self.version})

    def load_state(self, url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restore what `save_state` wrote; returns its `extra`. Every rank reads the files."""
        from rl_engine.storage import join, open_storage

        fs, root = open_storage(url, storage_options)
        if not fs.exists(join(root, ckpt.COMMIT_MARKER)):
            raise UserError(
                f"{url}: no committed trainer state here ({ckpt.COMMIT_MARKER} missing); it was never written or its save did not finish"
            )
        meta = ckpt.read_json(fs, join(root, "state.json"))
        ckpt.check_format(meta, url)
        mine = _adapter_shape(self.settings.lora)
        if meta.get("lora") != mine:
            raise UserError(
                f"{url}: trainer state saved with model.lora = {meta.get('lora')}, this trainer has {mine}; "
                "resume with the model.lora the run was started with (its config.yaml)"
            )
        weights = ckpt.read_tensors(fs, join(root, "model.safetensors"))
        opt_tensors = ckpt.read_tensors(fs, join(root, "optimizer.safetensors"))
        ckpt.restore_state(
            self.engine.module,
            self.engine.optimizer,
            weights,
            opt_tensors,
            meta["optimizer"],
            trainable_only=self.settings.lora is not None,
        )
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict({**self.engine.lr_scheduler.state_dict(), **meta["lr_scheduler"]})
        for k, v in meta["engine"].items():
            setattr(self.engine, k, v)
        ckpt.set_rng_state(ckpt.read_tensors(fs, join(root, "rng.safetensors")), meta["rng"])
        self.version = int(meta["version"])
        return meta["extra"]

    def close(self) -> None:
        """Nothing to release: the engine goes with the process (ranks > 0 are ended by rank 0's LeaderTrainer)."""

    def _to_device(self, batch: Batch, required: tuple[str, ...]) -> Batch:
        missing = [k for k in required if k not in batch]
        if missing:
            raise ValueError(f"train batch lacks {missing}; build it with ExperienceBatch.to_tensors(pad_id)")
        return {k: v.to(self.device) for k, v in batch.items()}


# -------------------------------------------------------------------- helpers


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _load_model(model_dir: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=_torch_dtype(dtype))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a causal LM from {model_dir!r}: {e}") from None


def _load_reference(model_dir: str, dtype: str, device: str) -> torch.nn.Module:
    """Frozen copy of the initial policy for the KL penalty (a full replica on every rank)."""
    ref = _load_model(model_dir, dtype).to(device).eval()
    ref.requires_grad_(False)
    return ref


def _zero_managed_any(module: torch.nn.Module) -> bool:
    return any(ckpt._zero_managed(p) for p in module.parameters())


def _grad_norm(module: torch.nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def _jsonable_scheduler_state(scheduler) -> dict[str, Any]:
    """The LR scheduler's state without its (unpicklable, rebuilt from config) lambdas."""
    if scheduler is None:
        return {}
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def _adapter_shape(lora: Any) -> dict[str, Any] | None:
    """What of model.lora a trainer state depends on (how the weights travel, `sync`, it does not)."""
    return None if lora is None else lora.model_dump(exclude={"sync"})
