"""LoRA on the trainer (model.lora): adapters only train, the KL reference is the base with the
adapter disabled, named_weights (what a sync sends) are the adapter in peft's file names, a saved
model is the merged weights (base + scaled B @ A), state holds the adapter.

.venv/bin/python -m pytest tests/rl_engine/trainer/test_lora.py -q -m "slow or not slow"
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from trainer_helpers import grpo_case, make_batch, make_cfg

from rl_engine.errors import UserError
from rl_engine.trainer import build_trainer, trainer_settings

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "mlp.down_proj"]}
TARGETS = ("q_proj", "v_proj", "down_proj")


def lora_trainer(model_dir: str, **lora):
    algo, _ = grpo_case()  # KL on: the reference path runs
    cfg = make_cfg(model_dir, model={"lora": {**LORA, **lora}}, algorithm=algo, trainer={"lr": 1e-2})
    return build_trainer(trainer_settings(cfg))


def base_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def stepped(tiny_model_dir):
    """A LoRA trainer after two GRPO steps with KL, and the batch builder."""
    _, build = grpo_case()
    tr = lora_trainer(tiny_model_dir)
    for _ in range(2):
        tr.train_step(build(tr))
    return tr


def test_only_adapters_train_and_the_base_stays(stepped, tiny_model_dir):
    tr = stepped
    module = tr.engine.module
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 hidden layers x 3 targets x (A, B)
    assert len(trainable) == 2 * len(TARGETS) * 2
    assert all(any(f"{t}.lora_" in n for t in TARGETS) for n in trainable)
    base = base_weights(tiny_model_dir)
    frozen = {
        n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
        for n, p in module.named_parameters()
        if not p.requires_grad
    }
    assert frozen.keys() == base.keys()
    for n, p in frozen.items():
        assert torch.equal(p, base[n]), n  # bitwise: two steps did not touch the base
    # the adapters did move: B starts at 0
    assert all(float(p.detach().abs().max()) > 0 for n, p in module.named_parameters() if ".lora_B." in n)
    opt = tr.engine.optimizer
    opt_params = {id(p) for g in getattr(opt, "optimizer", opt).param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in module.parameters() if p.requires_grad}  # no optimizer state for the base


def test_kl_reference_is_the_base_with_the_adapter_disabled(stepped, tiny_model_dir):
    tr = stepped
    assert tr.reference is None  # no second copy of the weights
    batch = make_batch(seed=7)
    plain = build_trainer(trainer_settings(make_cfg(tiny_model_dir)))  # full fine-tuning trainer, untrained: the base
    base = plain.compute_logprobs(batch)
    ref = tr._reference_logprobs(batch)
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-6)
    current = tr.compute_logprobs(batch)
    assert float((current - base).abs().max()) > 1e-3  # the adapter is on again, and it changed the policy
    assert all(p.requires_grad for n, p in tr.engine.module.named_parameters() if ".lora_" in n)


def test_named_weights_are_the_adapter_as_peft_files_name_it(stepped, tiny_model_dir):
    """What a weight sync sends: the adapter only, each tensor under the name peft's adapter file
    gives it, equal to the trained parameter."""
    tr = stepped
    sent = {n: t.clone() for n, t in tr.named_weights()}
    params = dict(tr.engine.module.named_parameters())
    assert sent.keys() == {n.replace(".default.", ".") for n, p in params.items() if p.requires_grad}
    assert {n.split(".")[-3] for n in sent} == set(TARGETS) and {n.split(".")[-2] for n in sent} == {"lora_A", "lora_B"}
    for name, t in sent.items():
        assert torch.equal(t, params[name.replace(".weight", ".default.weight")])
    base = sum(p.numel() for n, p in params.items() if not p.requires_grad)
    assert sum(t.numel() for t in sent.values()) < 0.2 * base  # the tiny model's adapter; SmolLM2's is ~1%: bench.lora


def test_with_sync_merged_a_sync_sends_the_merged_model_and_engines_serve_no_adapter(tiny_model_dir):
    """model.lora.sync: merged: the trainer's sync weights are the base model's names and shapes
    (the merged model, checked value by value below), the engines start without LoRA, checkpoints
    are an ordinary model's, and an engine server is allowed."""
    from rl_engine.adapter import synced_adapter
    from rl_engine.config import LoRAConfig, validate_config
    from rl_engine.trainer.lora import merged_weights

    tr = lora_trainer(tiny_model_dir, sync="merged")
    sent = dict(tr.named_weights())
    assert sent.keys() == base_weights(tiny_model_dir).keys()
    assert all(torch.equal(sent[n], t) for n, t in merged_weights(tr.engine.module))
    cfg = make_cfg(tiny_model_dir, model={"lora": {**LORA, "sync": "merged"}})
    assert synced_adapter(cfg.model.lora) is None and synced_adapter(LoRAConfig(**LORA)) is not None
    served = {"explorer": {"engine": {"servers": ["http://127.0.0.1:8100"]}}}
    validate_config({**cfg.model_dump(mode="json"), **served})
    with pytest.raises(Exception, match=r"model.lora.sync = 'adapter'.*set model.lora.sync: merged"):
        validate_config(
            {**cfg.model_dump(mode="json"), "model": {**cfg.model.model_dump(mode="json"), "lora": LORA}, **served}
        )


def test_merged_weights_are_base_plus_scaled_b_a(stepped, tiny_model_dir):
    from rl_engine.trainer.lora import merged_weights

    tr = stepped
    base = base_weights(tiny_model_dir)
    merged = {n: t.clone() for n, t in merged_weights(tr.engine.module)}
    assert merged.keys() == base.keys()  # the base model's HF names, nothing of peft's
    params = dict(tr.engine.module.named_parameters())
    scale = LORA["alpha"] / LORA["rank"]
    checked = 0
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".")[-1] in TARGETS:
            a = params[f"base_model.model.{module}.lora_A.default.weight"]  # [r, in]
            b = params[f"base_model.model.{module}.lora_B.default.weight"]  # [out, r]
            torch.testing.assert_close(merged[name], w + scale * (b @ a).detach(), rtol=0, atol=1e-6)
            assert float((merged[name] - w).abs().max()) > 0
            checked += 1
        else:
            assert torch.equal(merged[name], w), name
    assert checked == 2 * len(TARGETS)


def test_logprobs_of_the_merged_model_are_the_trainers(stepped, tmp_path):
    """save_hf: a merged model transformers loads without peft (what the explorers load: its logprobs
    are the trainer's), and the adapter in peft's layout beside it, equal to the merged model applied."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tr = stepped
    out = tmp_path / "hf"
    tr.save_hf(str(out))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert {p.name for p in (out / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == LORA["rank"]
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in n for n in load_file(out / "model.safetensors"))
    batch = make_batch(seed=4)
    ids, am = batch["input_ids"], batch["attention_mask"]
    tr.engine.module.eval()
    with torch.no_grad():
        ours = tr.engine.module(input_ids=ids, attention_mask=am).logits  # [B, L, V]
        theirs = merged(input_ids=ids, attention_mask=am).logits
        base = AutoModelForCausalLM.from_pretrained(tr.settings.model_path, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
        via_peft = adapted(input_ids=ids, attention_mask=am).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(via_peft, theirs, rtol=0, atol=1e-4)


def test_state_holds_the_adapter_and_resume_restores_it_exactly(tiny_model_dir, tmp_path):
    _, build = grpo_case()
    a = lora_trainer(tiny_model_dir)
    for _ in range(2):
        a.train_step(build(a))
    a.save_state(str(tmp_path / "state"), extra={"step": 2})
    saved = load_file(tmp_path / "state" / "model.safetensors")
    adapters = {n: p for n, p in a.engine.module.named_parameters() if p.requires_grad}
    assert saved.keys() == adapters.keys()  # the adapter only: the base is model.path's
    opt = load_file(tmp_path / "state" / "optimizer.safetensors")
    assert {k.rsplit(".", 1)[0] for k in opt} == adapters.keys()
    meta = json.loads((tmp_path / "state" / "state.json").read_text())
    assert meta["lora"]["rank"] == LORA["rank"]

    b = lora_trainer(tiny_model_dir)
    assert b.load_state(str(tmp_path / "state")) == {"step": 2}
    assert b.version == 2
    for n, p in b.engine.module.named_parameters():
        other = dict(a.engine.module.named_parameters())[n]
        assert torch.equal(p, other), n
    base_a = getattr(a.engine.optimizer, "optimizer", a.engine.optimizer)
    base_b = getattr(b.engine.optimizer, "optimizer", b.engine.optimizer)
    pa, pb = dict(a.engine.module.named_parameters()), dict(b.engine.module.named_parameters())
    for n in adapters:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(base_a.state[pa[n]][key], base_b.state[pb[n]][key]), (n, key)
    batch = build(a)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    for n in adapters:
        assert torch.equal(pa[n], pb[n]), n

    full = build_trainer(trainer_settings(make_cfg(tiny_model_dir)))
    with pytest.raises(UserError, match="saved with model.lora"):
        full.load_state(str(tmp_path / "state"))
    other_rank = lora_trainer(tiny_model_dir, rank=2)
    with pytest.raises(UserError, match="model.lora"):
        other_rank.load_state(str(tmp_path / "state"))


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_1_and_2_train_the_adapter_as_stage_0_does_and_resume_exactly(tiny_model_dir, tmp_path, zero_stage):
    """ZeRO 1/2 partition the adapter's optimizer state (one rank here: all of it): the base stays
    bitwise, the steps are stage 0's within fp32 reduction order, and a resume from its state gives
    the identical next step."""
    _, build = grpo_case()
    batches = []

    def trainer(stage: int):
        algo, _ = grpo_case()
        cfg = make_cfg(tiny_model_dir, model={"lora": LORA}, algorithm=algo, trainer={"lr": 1e-2, "zero_stage": stage})
        return build_trainer(trainer_settings(cfg))

    plain, zero = trainer(0), trainer(zero_stage)
    assert zero.engine.zero_optimization_stage() == zero_stage
    for _ in range(2):
        batches.append(build(plain))
        a, b = plain.train_step(batches[-1]), zero.train_step(batches[-1])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    ours, theirs = dict(zero.named_weights()), dict(plain.named_weights())
    assert ours.keys() == theirs.keys() and all(".lora_" in n for n in ours)
    for n, w in ours.items():
        assert torch.allclose(w, theirs[n], rtol=1e-4, atol=1e-6), n
    base = base_weights(tiny_model_dir)
    frozen = {
        n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
        for n, p in zero.engine.module.named_parameters()
        if not p.requires_grad
    }
    assert frozen.keys() == base.keys() and all(torch.equal(p, base[n]) for n, p in frozen.items())

    zero.save_state(str(tmp_path / "state"), extra={})
    resumed = trainer(zero_stage)
    resumed.load_state(str(tmp_path / "state"))
    batch = build(zero)
    assert zero.train_step(batch) == resumed.train_step(batch)
    for (n, p), (_, q) in zip(zero.named_weights(), resumed.named_weights()):
        assert torch.equal(p, q), n


def test_zero3_with_lora_is_refused(tiny_model_dir):
    from rl_engine.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="zero_stage = 3 is refused"):
        make_cfg(tiny_model_dir, model={"lora": LORA}, trainer={"zero_stage": 3})


def test_preflight_names_missing_target_modules(tiny_model_dir):
    from rl_engine.run.preflight import check_lora_targets, check_model_dir

    _, weights = check_model_dir(tiny_model_dir)
    cfg = make_cfg(tiny_model_dir, model={"lora": {**LORA, "target_modules": ["q_proj", "qkv_proj", "mlp.up_proj"]}})
    with pytest.raises(UserError, match=r"\['qkv_proj'\] match no linear module") as e:
        check_lora_targets(cfg.model, weights)
    assert "q_proj" in str(e.value) and "down_proj" in str(e.value)  # names what there is
    check_lora_targets(make_cfg(tiny_model_dir, model={"lora": LORA}).model, weights)  # all present: passes
    with pytest.raises(ValueError, match="greater than 0"):
        make_cfg(tiny_model_dir, model={"lora": {**LORA, "rank": 0}})


def test_the_defaults_adapt_every_linear_projection_of_the_model(tiny_model_dir):
    """`model.lora: {}` is docs/guides/gpus.md's line: rank 8, alpha 16, every linear projection
    (configs/smollm2-lora.yaml's adapters, which learned as full fine-tuning does); preflight finds
    each in a Qwen2 model."""
    from rl_engine.run.preflight import check_lora_targets, check_model_dir

    lora = make_cfg(tiny_model_dir, model={"lora": {}}).model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.sync) == (8, 16.0, 0.0, "adapter")
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    shipped = yaml.safe_load((REPO / "configs" / "smollm2-lora.yaml").read_text())["model"]["lora"]
    assert {k: shipped[k] for k in ("rank", "alpha", "target_modules")} == {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "target_modules": lora.target_modules,
    }
    check_lora_targets(make_cfg(tiny_model_dir, model={"lora": {}}).model, check_model_dir(tiny_model_dir)[1])


def test_adapter_shapes_are_what_the_trainer_state_holds(stepped, tiny_model_dir):
    from rl_engine.adapter import adapter_shapes
    from rl_engine.config import LoRAConfig
    from rl_engine.run.preflight import check_model_dir

    _, weights = check_model_dir(tiny_model_dir)
    expected = adapter_shapes(weights, LoRAConfig(**LORA))
    held = {n: tuple(p.shape) for n, p in stepped.engine.module.named_parameters() if p.requires_grad}
    assert expected == held
