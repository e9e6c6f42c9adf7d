"""The policy model and the task set it is trained on, with the reward variants that score it."""

from __future__ import annotations

import re
import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rl_engine.config.base import Kwargs, _Model, check_registered, variants
from rl_engine.config.workflow import SingleTurnWorkflow, UserCodeConfig, WorkflowConfig
from rl_engine.registry import IMPORT_PATH, REWARDS, TASKS

# Every linear projection of a Llama-, Qwen- or Mistral-style decoder layer (attention and MLP).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(_Model):
    """LoRA adapters on the policy (peft, rl_engine.trainer.lora): only the adapters train, the base
    stays frozen; weight sync sends the adapter only, which the explorers' engines serve on the base
    (`sync: adapter`), or the merged weights to engines serving an ordinary model (`sync: merged`)."""

    rank: int = Field(
        default=8,
        gt=0,
        le=512,
        description="Rank r of each adapter (A is r x in, B is out x r); vLLM serves up to 512.",
    )
    alpha: float = Field(
        default=16.0, gt=0.0, description="LoRA alpha: the adapter's update is scaled by alpha / rank."
    )
    dropout: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input while training (logprobs for the loss's reference terms are computed without it).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_LINEAR),
        min_length=1,
        description="Linear modules that get an adapter, by name or dotted suffix of the model's module names (e.g. q_proj, mlp.down_proj); preflight checks each exists. The default is every linear projection of a Llama-, Qwen- or Mistral-style decoder: with it, rank 8 at lr 1e-4 (configs/smollm2-lora.yaml) gained 0.97x full fine-tuning's held-out points on SmolLM2 in 30 steps.",
    )
    sync: Literal["adapter", "merged"] = Field(
        default="adapter",
        description="What a weight sync sends: `adapter`, the adapter only, installed in place in engines serving the base with vLLM's LoRA (about 1% of the model's bytes); `merged`, base + scaled B @ A under the model's own names, to engines without LoRA (every byte, but vLLM's CPU LoRA kernels generate several times slower than the plain model: bench.lora).",
    )


class ModelConfig(_Model):
    """The policy model: a local Hugging Face directory (nothing is ever downloaded; rl_engine.run.preflight checks it is one)."""

    path: str = Field(
        description="Local directory of a Hugging Face causal LM (config.json, *.safetensors, tokenizer files)."
    )
    tokenizer_path: str | None = Field(default=None, description="Tokenizer directory; defaults to `model.path`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Parameter dtype in both vLLM and the trainer. float32 keeps their logprobs tight on CPU.",
    )
    max_model_len: int = Field(
        default=512,
        ge=16,
        le=1_048_576,
        description="Context length (prompt + response tokens) for vLLM and the trainer.",
    )
    lora: LoRAConfig | None = Field(
        default=None,
        description="Train LoRA adapters instead of every weight; weight sync then sends the adapter only, served by vLLM's LoRA on the base model. null: full fine-tuning.",
    )


class ArithmeticReward(_Model):
    """Exact-answer reward for the demo arithmetic task, plus a format reward."""

    type: Literal["arithmetic"] = Field(description="Reward variant selector.")
    correct_weight: float = Field(default=1.0, description="Reward for an exactly correct final answer.")
    format_weight: float = Field(
        default=0.1, ge=0.0, description="Reward for a well-formed answer (digits only, then a stop)."
    )


class CountdownReward(_Model):
    """Reward of the long-tail countdown task: exact answer then a stop, plus shaped progress."""

    type: Literal["countdown"] = Field(description="Reward variant selector.")
    correct_weight: float = Field(default=1.0, description="Reward for exactly the answer, ended by a stop.")
    close_weight: float = Field(
        default=0.5,
        ge=0.0,
        description="Weight of the progress term: the fraction of the answer's numbers right from the start, over the longer of answer and response.",
    )


class FinalAnswerReward(_Model):
    """Reward of the chat model's word-arithmetic task: the last number of a response the model ended itself, exactly."""

    type: Literal["final_answer"] = Field(description="Reward variant selector.")
    correct_weight: float = Field(
        default=1.0, description="Reward when the response ended with a stop and its last number is the answer."
    )
    format_weight: float = Field(
        default=0.1, ge=0.0, description="Reward when the response ended with a stop and holds a number at all."
    )


class SandboxConfig(_Model):
    """Where generated code runs (rl_engine.rewards.sandbox): a process of its own in its own
    namespaces (no network, none of the machine's files but the system's and Python's, read-only),
    without rights, with these limits, killed whole at its timeout."""

    timeout_s: float = Field(
        default=5.0,
        gt=0.0,
        le=600.0,
        description="Wall-clock limit of one run; past it the run is killed and scores 0.",
    )
    cpu_s: int = Field(default=5, ge=1, le=600, description="CPU seconds one process of the run may use (RLIMIT_CPU).")
    memory_mb: int = Field(
        default=512, ge=32, le=65_536, description="Address space of each process of the run, in MiB (RLIMIT_AS)."
    )
    file_size_mb: int = Field(
        default=16, ge=1, le=65_536, description="Largest file the run may write, in MiB (RLIMIT_FSIZE)."
    )
    disk_mb: int = Field(
        default=64, ge=1, le=65_536, description="Size of the run's working directory (a tmpfs of its own), in MiB."
    )
    open_files: int = Field(default=64, ge=16, le=65_536, description="Open files of each process (RLIMIT_NOFILE).")
    processes: int = Field(
        default=16, ge=1, le=65_536, description="Processes and threads the run may have at once (RLIMIT_NPROC)."
    )
    output_kb: int = Field(
        default=64,
        ge=1,
        le=1_048_576,
        description="Output (stdout + stderr) kept; past it the run is killed and scores 0.",
    )
    allow_network: bool = Field(
        default=False,
        description="Where the kernel refuses namespaces, run the code anyway, with rlimits, a clean environment and a timeout only (it can reach the network and read what its user may); false: the run refuses to start there.",
    )


class CodeTestsReward(_Model):
    """The response's code (its last ```python block, else the whole response) run against the task's tests in the sandbox (rl_engine.rewards.code_tests)."""

    type: Literal["code_tests"] = Field(description="Reward variant selector.")
    tests_key: str = Field(
        default="tests",
        description="Task column holding the tests: a list of test strings (e.g. `assert f(2) == 4`) or one snippet whose top-level asserts are one test each.",
    )
    scoring: Literal["fraction", "all_or_nothing"] = Field(
        default="fraction", description="Reward: the fraction of tests passed, or 1 only when all pass."
    )
    workers: int = Field(
        default=2, ge=1, le=64, description="Sandbox runs of a step at once (threads, each on its own process)."
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Limits and isolation of each run.")


class ModelReward(_Model):
    """A Hugging Face sequence classifier with one output scores each (prompt, response), rendered
    with its tokenizer's chat template (else prompt + response), in a reward service process the
    run's explorers share (rl_engine.rewards.reward_model)."""

    type: Literal["model"] = Field(description="Reward variant selector.")
    path: str = Field(
        description="Local directory of a Hugging Face *ForSequenceClassification model with num_labels 1 and its tokenizer; preflight checks its config.json."
    )
    batch_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Most (prompt, response) pairs the service scores in one forward pass; a step's samples are sent this many at a time.",
    )
    max_length: int = Field(
        default=1024,
        ge=8,
        le=1_048_576,
        description="Tokens of a rendered pair the model reads; a longer one keeps its last max_length tokens (the score is read at the last).",
    )
    normalize: Literal["none", "running"] = Field(
        default="none",
        description="`running`: each score becomes (score - mean) / std over all scores this explorer has seen (Welford); `none`: the raw score.",
    )
    timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        description="Longest a request of batch_size pairs may wait for its scores (another explorer's batch may run first); past it the step's remaining samples fail as on_failure says.",
    )
    on_failure: Literal["failed_reward", "fail"] = Field(
        default="failed_reward",
        description="Samples the service did not score (timed out, service dead or failing): `failed_reward` scores them `taskset.user_code.failed_reward` (null: left out), counted; `fail` fails the step with an error naming the service.",
    )
    device: str = Field(default="cpu", description="torch device of the service's model: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Parameter dtype of the service's model; scores are returned as float32."
    )
    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="The address the service binds and explorers reach it at: loopback keeps it on one machine; under placement "
        "deployments, the reward role's machine's address the explorers' machines reach (not 0.0.0.0: explorers connect to it). "
        "Anyone who reaches it can make it compute.",
    )

    @field_validator("host")
    @classmethod
    def _reachable(cls, v: str) -> str:
        if v in ("0.0.0.0", "::", "[::]"):
            raise ValueError(
                f"host {v!r} binds every interface but is no address to connect to; give the machine's address the explorers reach"
            )
        return v


JUDGE_FIELDS = ("prompt", "response", "answer")


def template_fields(template: str) -> list[str]:
    """The placeholders of `template`; ValueError naming the bad one when it is not one of JUDGE_FIELDS."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(
            f"taskset.reward.template is not a format string ({e}); write braces as {{{{ and }}}}"
        ) from None
    for name in names:
        if name not in JUDGE_FIELDS:
            raise ValueError(
                f"taskset.reward.template has the placeholder {{{name}}}; it may use {{prompt}}, {{response}} and {{answer}} only "
                "(write a literal brace as {{ or }})"
            )
    if "response" not in names:
        raise ValueError("taskset.reward.template has no {response}: the judge would never see what it judges")
    return names


class JudgeReward(_Model):
    """A generative model judges each response: `template` filled with the sample, sent to an
    OpenAI-compatible endpoint, its reply read by `parser` (rl_engine.rewards.judge)."""

    type: Literal["judge"] = Field(description="Reward variant selector.")
    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible API root the requests go to, e.g. http://127.0.0.1:8100/v1 (a vLLM server: `rft engine serve`, `vllm serve`) or a hosted API's; or set path instead.",
        pattern=r"^https?://",
    )
    model: str | None = Field(
        default=None,
        description="Model name the endpoint at base_url serves (a vLLM server's: its --model path); with path, the path.",
    )
    path: str | None = Field(
        default=None,
        description="Local Hugging Face model directory of a judge the run serves itself: a vLLM engine of its own on loopback, started at the first step and shared by the explorers of a process; instead of base_url.",
    )
    max_model_len: int = Field(
        default=1024,
        ge=16,
        le=1_048_576,
        description="With path: the judge engine's longest prompt plus reply, in tokens.",
    )
    kv_cache_space_gib: float = Field(
        default=1.0, gt=0.0, description="With path: the judge engine's KV cache on CPU, GiB (on GPU vLLM sizes it)."
    )
    template: str = Field(
        default="Question: {prompt}\nProposed answer: {response}\nReference answer: {answer}\nIs the proposed answer correct? Answer yes or no.\nAnswer:",
        description="What the judge is asked per sample: a format string with {response} and optionally {prompt} and {answer} (the task's answer column).",
    )
    parser: str = Field(
        default="yes_no",
        description="How a reply becomes a reward: `yes_no` (first yes/no word: 1/0), `number` (first number), or `package.module:function` (text -> float or None).",
    )
    pattern: str | None = Field(
        default=None,
        description="Regular expression whose first group (or match) yes_no or number read instead of the first yes/no word or number.",
    )
    chat: bool = Field(
        default=False,
        description="Send the filled template as the one user message to /chat/completions; false: as the prompt of /completions.",
    )
    max_tokens: int = Field(default=16, ge=1, le=4096, description="Longest reply (greedy, temperature 0).")
    api_key_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of the environment variable holding the endpoint's key (sent as a bearer token); never the key itself. null: no key.",
    )
    concurrency: int = Field(default=8, ge=1, le=256, description="Requests of a step in flight at once.")
    timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        description="Longest one request may take; past it the step's requests not yet sent fail at once, as on_failure says.",
    )
    on_failure: Literal["failed_reward", "fail"] = Field(
        default="failed_reward",
        description="Samples not judged (timed out, endpoint unreachable or erring): `failed_reward` scores them `taskset.user_code.failed_reward` (null: left out), counted; `fail` fails the step naming the endpoint.",
    )

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        template_fields(v)
        return v

    @model_validator(mode="after")
    def _one_endpoint(self) -> JudgeReward:
        if (self.base_url is None) == (self.path is None):
            raise ValueError(
                "taskset.reward: set base_url (an OpenAI-compatible endpoint, with model) or path (a model directory the run serves on an engine of its own), one of them"
            )
        if self.base_url is not None and not self.model:
            raise ValueError(
                f"taskset.reward.model: the judge at base_url = {self.base_url!r} needs the model name it serves (a vLLM server's --model)"
            )
        return self

    @field_validator("parser")
    @classmethod
    def _parser(cls, v: str) -> str:
        if v not in ("yes_no", "number") and not re.match(IMPORT_PATH, v):
            raise ValueError(
                f"taskset.reward.parser = {v!r}: use yes_no, number or an import path package.module:function"
            )
        return v


class PythonReward(_Model):
    """A user reward `module:function(prompt, response, task[, finish_reason], **kwargs) -> float | dict[str, float]`
    (`rl_engine.api.Reward`), or with `batch: true` `function(samples, **kwargs) -> list` (`rl_engine.api.BatchReward`)."""

    type: Literal["python"] = Field(description="Reward variant selector.")
    function: str = Field(
        description="Import path `package.module:function` of the reward callable.", pattern=IMPORT_PATH
    )
    kwargs: Kwargs = Field(default_factory=dict, description="Extra keyword arguments passed to the function.")
    batch: bool = Field(
        default=False,
        description="The function scores a whole step's samples in one call (a list of (prompt, response, task, finish_reason)) and returns one reward or None per sample.",
    )
    timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        description="Longest one call may take; its worker process is then killed and replaced, and the sample (with batch: every sample of the call) scored as `taskset.user_code.failed_reward` says.",
    )


class RegisteredReward(_Model):
    """A reward a plugin registered (`@register_reward(name)` in a module of `plugins:`); it runs
    in the user-code pool like a `python` reward."""

    type: str = Field(description="The registered name.")
    kwargs: Kwargs = Field(default_factory=dict, description="Extra keyword arguments passed to the function.")
    batch: bool = Field(
        default=False, description="As for `type: python`: the function scores a whole step's samples at once."
    )
    timeout_s: float = Field(default=60.0, gt=0.0, description="As for `type: python`: the longest one call may take.")

    @field_validator("type")
    @classmethod
    def _registered(cls, v: str) -> str:
        return check_registered(REWARDS, v)


RewardConfig = variants(
    ArithmeticReward,
    CountdownReward,
    FinalAnswerReward,
    CodeTestsReward,
    ModelReward,
    JudgeReward,
    PythonReward,
    registered=RegisteredReward,
)
_REWARD_TAGS = ("arithmetic", "countdown", "final_answer", "code_tests", "model", "judge", "python", "registered")


class MakeTasksConfig(_Model):
    """A task maker that writes `taskset.path` when it does not exist yet (a run's first start)."""

    type: str = Field(
        description="A registered task maker (the names of `rft make-tasks --task`: arithmetic, countdown, ..., a plugin's), or `python` with `function`."
    )
    function: str | None = Field(
        default=None,
        description="With type python: the maker's import path `package.module:function`.",
        pattern=IMPORT_PATH,
    )
    n: int | None = Field(default=None, ge=1, description="Rows to make; null: the maker's own default.")
    seed: int = Field(default=0, ge=0, description="The maker's seed: the same arguments make the same rows.")
    kwargs: Kwargs = Field(default_factory=dict, description="The maker's other parameters.")

    @model_validator(mode="after")
    def _known(self) -> MakeTasksConfig:
        if self.type == "python":
            if self.function is None:
                raise ValueError("taskset.make.type = python needs taskset.make.function: package.module:function")
        else:
            check_registered(TASKS, self.type)
        return self


class TasksetConfig(_Model):
    """Where prompts come from and how they are scored."""

    path: str = Field(description="JSONL or Parquet file of tasks; a local path or any fsspec URL (s3://...).")
    prompt_key: str = Field(default="question", description="Column holding the prompt text.")
    answer_key: str = Field(default="answer", description="Column holding the reference answer passed to the reward.")
    template: str | None = Field(
        default=None,
        description="Python format string with `{prompt}`; if unset the tokenizer's chat template is used when it has one, else the raw prompt.",
    )
    shuffle: bool = Field(default=True, description="Shuffle task order each epoch (seeded by `seed`).")
    reward: RewardConfig = Field(
        default_factory=lambda: ArithmeticReward(type="arithmetic"), description="Reward function variant."
    )
    workflow: WorkflowConfig = Field(
        default_factory=lambda: SingleTurnWorkflow(type="single_turn"),
        description="What one episode of a task is: single_turn (prompt -> response), calculator, guess_number, python (a workflow by import path) or a plugin's registered name.",
    )
    user_code: UserCodeConfig = Field(
        default_factory=UserCodeConfig,
        description="Worker processes, timeouts and failure handling of user code (python rewards, workflow tool calls).",
    )
    make: MakeTasksConfig | None = Field(
        default=None,
        description="Make the task set with a task maker when taskset.path does not exist yet (never overwritten); null: the file must exist.",
    )
