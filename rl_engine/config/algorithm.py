"""The algorithm: a few orthogonal knobs (advantage, policy loss, aggregation, off-policy
correction, dynamic sampling, overlong shaping, KL), and named presets that expand into them.

    algorithm: {preset: dapo}                                  # DAPO's knobs
    algorithm: {preset: gspo, loss: {clip_eps_high: 5.0e-4}}   # a preset, one knob changed
    algorithm: {advantage: {type: rloo}, aggregation: seq-mean-token-mean}

`rft validate --print` shows what a preset expanded to. The tensor functions behind each knob are
in rl_engine/algorithms.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rl_engine.config.base import Kwargs, _Model, check_registered, variants
from rl_engine.registry import ESTIMATORS, IMPORT_PATH, LOSSES

StdLevel = Literal["group", "batch", "none"]


class KLConfig(_Model):
    """KL penalty to a frozen copy of the initial policy."""

    coef: float = Field(default=0.01, gt=0.0, description="Weight of the KL term in the loss.")
    estimator: Literal["k1", "k3"] = Field(default="k3", description="Per-token KL estimator (Schulman's k1 or k3).")


# ---- advantage estimators: what each reward is compared with, then how it is scaled


class GRPOAdvantage(_Model):
    """GRPO: reward minus its group's mean, divided by the group's std."""

    type: Literal["grpo"] = Field(
        description="Baseline: the mean reward of the experience's group (the rollouts of its task)."
    )
    std: StdLevel = Field(
        default="group",
        description="Divide the centred rewards by the std of their group, of the whole batch, or not at all.",
    )


class DrGRPOAdvantage(_Model):
    """Dr.GRPO: reward minus its group's mean, no std (pair it with a constant loss normaliser)."""

    type: Literal["dr_grpo"] = Field(description="Baseline: the group's mean reward; no std normalisation by default.")
    std: StdLevel = Field(
        default="none",
        description="Divide the centred rewards by the std of their group, of the whole batch, or not at all.",
    )


class RLOOAdvantage(_Model):
    """RLOO: reward minus the mean of the *other* rewards of its group (leave one out)."""

    type: Literal["rloo"] = Field(
        description="Baseline: the mean reward of the group's other members (an unbiased baseline)."
    )
    std: StdLevel = Field(
        default="none",
        description="Divide the centred rewards by the std of their group, of the whole batch, or not at all.",
    )


class ReinforcePPAdvantage(_Model):
    """REINFORCE++: reward minus the batch's mean reward, whitened over the batch."""

    type: Literal["reinforce_pp"] = Field(
        description="Baseline: the mean reward of the whole trainer batch (a global baseline)."
    )
    std: StdLevel = Field(
        default="batch",
        description="Divide the centred rewards by the std of their group, of the whole batch, or not at all.",
    )


class PythonAdvantage(_Model):
    """A user estimator `package.module:function(rewards [B], group_index [B], **kwargs) -> advantages [B]`
    (`rl_engine.api.AdvantageEstimator`), not registered."""

    type: Literal["python"] = Field(description="A user function named by import path.")
    function: str = Field(description="Import path `package.module:function` of the estimator.", pattern=IMPORT_PATH)
    kwargs: Kwargs = Field(default_factory=dict, description="Keyword arguments passed on every call.")


class RegisteredAdvantage(_Model):
    """An estimator a plugin registered (`@register_estimator(name)` in a module of `plugins:`)."""

    type: str = Field(description="The registered name.")
    kwargs: Kwargs = Field(default_factory=dict, description="Keyword arguments passed on every call.")

    @field_validator("type")
    @classmethod
    def _registered(cls, v: str) -> str:
        return check_registered(ESTIMATORS, v)


AdvantageConfig = variants(
    GRPOAdvantage, DrGRPOAdvantage, RLOOAdvantage, ReinforcePPAdvantage, PythonAdvantage, registered=RegisteredAdvantage
)

# ---- policy losses (the ratio's denominator is `proximal`; the corrections below weight them)


class PPOClipLoss(_Model):
    """PPO-clip on the token-level ratio pi / pi_proximal, asymmetric clip (DAPO's clip-higher when high > low)."""

    type: Literal["ppo_clip"] = Field(description="Token-level PPO-clip.")
    clip_eps_low: float = Field(default=0.2, gt=0.0, lt=1.0, description="Lower clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = Field(default=0.2, gt=0.0, lt=10.0, description="Upper clip: ratio <= 1 + clip_eps_high.")


class GSPOLoss(_Model):
    """GSPO: the sequence-level ratio (geometric mean of the token ratios), clipped per sequence."""

    type: Literal["gspo"] = Field(
        description="Sequence-level PPO-clip (GSPO-token form: every token of a sequence shares its ratio)."
    )
    clip_eps_low: float = Field(
        default=3e-4, gt=0.0, lt=1.0, description="Lower clip of the sequence ratio (GSPO's paper: 3e-4)."
    )
    clip_eps_high: float = Field(
        default=4e-4, gt=0.0, lt=10.0, description="Upper clip of the sequence ratio (GSPO's paper: 4e-4)."
    )


class CISPOLoss(_Model):
    """CISPO: -sg(clip(ratio)) * A * log pi on every token (the clip bounds the weight, never drops the gradient)."""

    type: Literal["cispo"] = Field(
        description="Clipped importance-sampling weight, stop-gradient, REINFORCE on all tokens."
    )
    clip_eps_low: float | None = Field(
        default=None, gt=0.0, lt=1.0, description="Lower bound 1 - clip_eps_low of the weight; null: no lower bound."
    )
    clip_eps_high: float = Field(
        default=1.0, gt=0.0, lt=100.0, description="Upper bound 1 + clip_eps_high of the weight."
    )


class KimiLoss(_Model):
    """Kimi k1.5's mirror-descent objective, per token: -A log pi + tau/2 (log pi - log pi_proximal)^2."""

    type: Literal["kimi"] = Field(
        description="k1.5's loss: policy gradient plus a squared log-ratio penalty that keeps pi near pi_proximal."
    )
    tau: float = Field(default=0.1, gt=0.0, description="Weight tau of the squared log-ratio penalty.")


class PythonLoss(_Model):
    """A user policy loss `package.module:function(logprobs, proximal, advantages, mask, **kwargs)` ->
    per-token loss [B, L] or (loss, clipped) (`rl_engine.api.PolicyLoss`), not registered."""

    type: Literal["python"] = Field(description="A user function named by import path.")
    function: str = Field(description="Import path `package.module:function` of the loss.", pattern=IMPORT_PATH)
    kwargs: Kwargs = Field(default_factory=dict, description="Keyword arguments passed on every call.")


class RegisteredLoss(_Model):
    """A policy loss a plugin registered (`@register_loss(name)` in a module of `plugins:`)."""

    type: str = Field(description="The registered name.")
    kwargs: Kwargs = Field(default_factory=dict, description="Keyword arguments passed on every call.")

    @field_validator("type")
    @classmethod
    def _registered(cls, v: str) -> str:
        return check_registered(LOSSES, v)


LossConfig = variants(PPOClipLoss, GSPOLoss, CISPOLoss, KimiLoss, PythonLoss, registered=RegisteredLoss)


class CorrectionConfig(_Model):
    """Off-policy correction: the weight w = pi_proximal / pi_behavior (trainer vs vLLM) of each token
    or sequence, applied to its loss; outside [low, high] it is clamped or the token/sequence masked.

    Truncated IS: {level: token, action: clamp, low: 0, high: 2}; icepop: {level: token, action: mask,
    low: 0.5, high: 2}; geometric sequence mask: {level: sequence, action: mask, low: 0.999, high: 1.001}.
    """

    level: Literal["token", "sequence"] = Field(
        default="token", description="A weight per token, or per sequence (the geometric mean of its token weights)."
    )
    action: Literal["clamp", "mask"] = Field(
        default="clamp",
        description="Outside [low, high]: clamp the weight to the bound, or drop the token (sequence) from the loss.",
    )
    low: float = Field(default=0.0, ge=0.0, description="Lower bound of the weight.")
    high: float = Field(default=2.0, gt=0.0, description="Upper bound of the weight.")

    @model_validator(mode="after")
    def _ordered(self) -> CorrectionConfig:
        if self.low >= self.high:
            raise ValueError(f"algorithm.correction: low = {self.low} must be below high = {self.high}")
        return self


class OverlongConfig(_Model):
    """What happens to responses near or at the token budget (DAPO's overlong shaping)."""

    buffer_fraction: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Soft overlong punishment: over the last buffer_fraction x max response tokens, the reward falls linearly by up to `penalty`; null: off.",
    )
    penalty: float = Field(
        default=1.0,
        gt=0.0,
        description="Reward taken from a response that reaches the token budget (linear from 0 at the buffer's start).",
    )
    mask_truncated: bool = Field(
        default=False,
        description="Leave responses cut by the token budget (finish reason length or truncated) out of the loss.",
    )


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage": {"type": "grpo"}, "loss": {"type": "ppo_clip"}, "aggregation": "token-mean"},
    "dr_grpo": {
        "advantage": {"type": "dr_grpo"},
        "loss": {"type": "ppo_clip"},
        "aggregation": "seq-mean-token-sum",
        "token_sum_divisor": "max_tokens",
    },
    "dapo": {
        "advantage": {"type": "grpo"},
        "loss": {"type": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.28},
        "aggregation": "token-mean",
        "dynamic_sampling": True,
        "overlong": {"buffer_fraction": 0.25, "penalty": 1.0},
    },
    "gspo": {"advantage": {"type": "grpo"}, "loss": {"type": "gspo"}, "aggregation": "seq-mean-token-mean"},
    "rloo": {"advantage": {"type": "rloo"}, "loss": {"type": "ppo_clip"}, "aggregation": "token-mean"},
    "reinforce_pp": {"advantage": {"type": "reinforce_pp"}, "loss": {"type": "ppo_clip"}, "aggregation": "token-mean"},
    "kimi": {"advantage": {"type": "dr_grpo"}, "loss": {"type": "kimi"}, "aggregation": "token-mean"},
    "decoupled_ppo": {
        "advantage": {"type": "grpo"},
        "loss": {"type": "ppo_clip"},
        "aggregation": "token-mean",
        "proximal": "recompute",
        "correction": {"level": "token", "action": "clamp", "low": 0.0, "high": 2.0},
    },
}
Preset = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "kimi", "decoupled_ppo"]


class AlgorithmConfig(_Model):
    """The RL algorithm as orthogonal knobs; `preset` fills the knobs a config leaves out."""

    preset: Preset = Field(
        default="grpo",
        description="Named combination of the knobs below, the base the knobs a config sets are laid over; `rft validate --print` shows the expansion.",
    )
    repeat_times: int = Field(default=4, ge=1, le=1024, description="Rollouts per task (the group size).")
    advantage: AdvantageConfig = Field(
        default_factory=lambda: GRPOAdvantage(type="grpo"),
        description="Advantage estimator: grpo | dr_grpo | rloo | reinforce_pp, python (a function by import path) or a plugin's registered name.",
    )
    loss: LossConfig = Field(
        default_factory=lambda: PPOClipLoss(type="ppo_clip"),
        description="Policy loss: ppo_clip | gspo | cispo | kimi, python (a function by import path) or a plugin's registered name.",
    )
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        default="token-mean",
        description="Per-token losses to one number: mean over all tokens, or per sequence (token mean or sum) then mean over sequences.",
    )
    token_sum_divisor: int | Literal["max_tokens"] | None = Field(
        default=None,
        description="seq-mean-token-sum only: divide each sequence's token sum by this constant (Dr.GRPO: `max_tokens`, the response token budget); null: 1.",
    )
    proximal: Literal["behavior", "recompute"] = Field(
        default="behavior",
        description="The ratio's denominator: vLLM's behavior logprobs, or the trainer's own logprobs recomputed before the update (decoupled PPO; needed by `correction`).",
    )
    correction: CorrectionConfig | None = Field(
        default=None, description="Off-policy correction of proximal vs behavior; null: none."
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="Leave groups whose rewards are all equal out of the loss and its normalisers (DAPO); they are consumed and counted as filtered.",
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig, description="Reward shaping and masking of responses at the token budget."
    )
    kl: KLConfig | None = Field(
        default=None, description="KL penalty to the initial policy; null disables it (and the reference model)."
    )
    strict_preset: bool = Field(
        default=False,
        description="Refuse a config that overrides its preset's advantage type, loss type or aggregation (without it: a warning), so that asking for a preset never silently gives a hybrid.",
    )
    max_version_gap: int | None = Field(
        default=None,
        ge=0,
        description="Mask response tokens produced by a policy more than this many versions older than the trainer's; null keeps all.",
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset", "grpo") not in PRESETS:
            return data  # not a section, or an unknown preset: the fields' own validation names it
        out = _merge(PRESETS[data.get("preset", "grpo")], data)
        if "token_sum_divisor" not in data and out.get("aggregation") != "seq-mean-token-sum":
            out.pop("token_sum_divisor", None)  # the preset's divisor belongs to the aggregation the config replaced
        return out

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.repeat_times < 2:
            raise ValueError(
                f"algorithm.repeat_times = {self.repeat_times}: group advantages need at least 2 rollouts per task to compare; set it >= 2"
            )
        if self.token_sum_divisor is not None and self.aggregation != "seq-mean-token-sum":
            raise ValueError(
                f"algorithm.token_sum_divisor is set but algorithm.aggregation is {self.aggregation!r}; it applies to seq-mean-token-sum only: remove it or change the aggregation"
            )
        if isinstance(self.token_sum_divisor, int) and self.token_sum_divisor < 1:
            raise ValueError(f"algorithm.token_sum_divisor = {self.token_sum_divisor} must be >= 1 (or `max_tokens`)")
        if self.strict_preset and (hybrid := self.hybrid()):
            raise ValueError(
                f"algorithm.strict_preset: the config overrides preset {self.preset!r}'s {', '.join(hybrid)}; "
                "remove those fields to run the preset, or set strict_preset: false to run the hybrid"
            )
        if self.correction is not None and self.proximal != "recompute":
            raise ValueError(
                "algorithm.correction needs algorithm.proximal: recompute: with proximal = behavior the weight it corrects is pi_behavior / pi_behavior = 1; "
                "set proximal: recompute (decoupled PPO), or remove the correction"
            )
        return self

    def overrides(self) -> list[tuple[str, Any, Any]]:
        """(field, the preset's value, this config's) for every knob that differs from what
        `preset` alone expands to (repeat_times aside: presets do not set it)."""
        base = AlgorithmConfig(preset=self.preset, repeat_times=self.repeat_times).model_dump()
        return [d for d in _diff(base, self.model_dump(), "algorithm.") if d[0] != "algorithm.strict_preset"]

    def hybrid(self) -> list[str]:
        """The overrides that change what the preset is (its advantage type, loss type or
        aggregation), as `field = value (preset: value)`; empty when preset was not given."""
        if "preset" not in self.model_fields_set:
            return []
        kinds = ("algorithm.advantage.type", "algorithm.loss.type", "algorithm.aggregation")
        return [f"{k} = {v!r} (preset: {p!r})" for k, p, v in self.overrides() if k in kinds]

    def describe(self) -> str:
        """One line: the effective algorithm, the preset it started from and the fields that override it."""
        over = self.overrides()
        changed = (
            "; overrides: " + ", ".join(f"{k.removeprefix('algorithm.')}={v!r}" for k, _, v in over) if over else ""
        )
        return (
            f"algorithm: preset {self.preset} -> advantage {self.advantage.type}, loss {self.loss.type}, "
            f"aggregation {self.aggregation}, proximal {self.proximal}{changed}"
        )


def _diff(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted field, a's value, b's) where two dumped sections differ; a changed `type` is one
    difference (the variants' other fields are not comparable)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.get("type") != b.get("type"):
            return [(f"{prefix}type", a.get("type"), b.get("type"))]
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s keys on top; nested sections merge key by key unless `over` changes their `type`."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        b = out.get(k)
        same_kind = isinstance(b, dict) and isinstance(v, dict) and v.get("type", b.get("type")) == b.get("type")
        out[k] = _merge(b, v) if same_kind else copy.deepcopy(v)
    return out
