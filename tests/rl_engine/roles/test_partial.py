"""Partial rollouts without an engine: how a segment ends, how a step fills its batch, what a crash leaves.

The engine here is scripted: each prompt's continuation is a fixed string, handed out
`max_tokens` characters at a time (the tiny model's tokenizer: one token per character) and
ended as vLLM ends a request, repetition detection on the segment's own tokens included. That
isolates the segment logic; the real-engine tests are in tests/rl_engine/sync/test_partial_engine.py.

    .venv/bin/python -m pytest tests/rl_engine/roles/test_partial.py
"""

from __future__ import annotations

import pytest
from vllm.sampling_params import RepetitionDetectionParams
from vllm.v1.core.sched.utils import check_sequence_repetition

from rl_engine.buffer import BufferWriter, ContinuationStore, _files
from rl_engine.buffer.stats import commit_records
from rl_engine.config import PartialRolloutConfig, SamplingConfig
from rl_engine.rewards import Task, TaskIterator
from rl_engine.roles.groups import Generation
from rl_engine.roles.partial import PartialRollouts, PartialSettings, repeat_cut, response_text, stop_cut
from rl_engine.rollout.engine import Rollout
from rl_engine.storage import join, open_storage
from rl_engine.tiny_model import build_tokenizer

TOK = build_tokenizer()


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


class ScriptedEngine:
    """Continues prompt "<task>:" + response so far with answers[task] (then EOS); records calls.

    answers[task] may be a list: fresh prompts of that task take its answers in turn, and a
    continuation goes on with the answer it started."""

    def __init__(self, answers: dict[str, str | list[str]]):
        self.answers, self.version, self.calls, self.turn = answers, 0, [], 0
        self.tokenizer = TOK

    def _answer(self, task: str, done: str) -> str:
        options = self.answers[task] if isinstance(self.answers[task], list) else [self.answers[task]]
        if done:
            return next(a for a in options if a.startswith(done))
        self.turn += 1
        return options[(self.turn - 1) % len(options)]

    def generate(self, prompts, n, sampling, seed, max_tokens=None, repeat=None):
        out = []
        for p, budget in zip(prompts, max_tokens):
            text = TOK.decode(p)
            task, done = text.split(":", 1)
            full = ids(self._answer(task, done)) + [TOK.eos_token_id]
            got, reason = vllm_segment(full[len(ids(done)) :] if done else full, budget, repeat)
            out.append(
                [
                    Rollout(
                        prompt_ids=p,
                        response_ids=got,
                        logprobs=[-0.5] * len(got),
                        finish_reason=reason,
                        version=self.version,
                    )
                ]
            )
        self.calls.append(
            {
                "prompts": len(prompts),
                "seed": seed,
                "max_tokens": list(max_tokens),
                "finish_reasons": [r.finish_reason for (r,) in out],
            }
        )
        return out


def vllm_segment(rest: list[int], budget: int, repeat: tuple[int, int] | None) -> tuple[list[int], str]:
    """What vLLM emits of `rest` (ending with EOS) under max_tokens = budget: its scheduler appends a
    token, then checks EOS, the budget, and repetition over the request's output tokens, which are
    this segment's only (vllm/v1/core/sched/utils.py check_stop); the token that ends it is kept."""
    detect = (
        RepetitionDetectionParams(max_pattern_size=repeat[0], min_pattern_size=1, min_count=repeat[1])
        if repeat
        else None
    )
    for k in range(1, len(rest) + 1):  # returns by the EOS at the latest
        got = rest[:k]
        if got[-1] == TOK.eos_token_id:
            return got, "stop"
        if k >= budget:
            return got, "length"
        if detect and check_sequence_repetition(got, detect):
            return got, "repeat"
    raise AssertionError("a scripted continuation ends with EOS")


LONG = "0123456789abcdefghijklmnopqrstuvwxyzABCD"  # no repeats


def settings(
    batch_size=2, repeat_times=2, segment=4, max_response=12, stop=(), in_flight=None, max_model_len=64, **partial
) -> PartialSettings:
    p = PartialRolloutConfig(
        enabled=True,
        segment_max_tokens=segment,
        max_response_tokens=max_response,
        max_groups_in_flight=in_flight,
        **partial,
    )
    return PartialSettings(p, SamplingConfig(stop=list(stop)), batch_size, repeat_times, max_model_len, None, 0, 0)


def reward(prompt, response, task, finish_reason):
    return float(response == task.answer)


def make(tmp_path, answers: dict[str, str], first_step=1, **kw) -> tuple[PartialRollouts, ScriptedEngine]:
    engine = ScriptedEngine(answers)
    tasks = TaskIterator(
        [Task(t, t + ":", a if isinstance(a, str) else a[0]) for t, a in answers.items()], 1, seed=0, shuffle=False
    )
    store = ContinuationStore(*open_storage(str(tmp_path), {}), 0, fsync=False)
    return PartialRollouts(engine, store, tasks, reward, settings(**kw), first_step), engine


def run_step(p: PartialRollouts, writer: BufferWriter, e: int):
    batch, m = p.generate(e)
    p.stage(e, batch)
    writer.write(e, batch)
    p.committed(e)
    return batch, m


# --------------------------------------------------------------------------- ending a segment


def test_stop_string_across_a_segment_boundary_is_found_in_the_tokens():
    resp = ids("abc##de")
    # Segment 1 ended after "abc#", segment 2 after "##de": the stop "##" spans the boundary.
    assert stop_cut(TOK, resp, since=4, stops=["##"]) == 5  # keep "abc##" (the stop's tokens stay, as vLLM keeps them)
    assert stop_cut(TOK, resp, since=4, stops=["zz"]) is None
    assert response_text(TOK, resp[:5], ["##"]) == "abc"


def test_repetition_across_a_segment_boundary():
    resp = ids("xyabababab")  # "ab" x4: with n <= 2, count 4 the loop completes at token 10
    assert repeat_cut(resp, since=6, ngram=2, count=4) == 10
    assert repeat_cut(resp, since=6, ngram=2, count=5) is None
    assert repeat_cut(ids("aaaa"), since=2, ngram=1, count=3) == 3  # found at the first prefix that repeats


def test_scripted_engine_ends_a_segment_as_vllm_does():
    engine = ScriptedEngine({"a": "qabababab"})

    def segment(done: str, budget: int) -> tuple[list[int], str]:
        ((r,),) = engine.generate([ids("a:" + done)], 1, None, 0, max_tokens=[budget], repeat=(2, 3))
        return r.response_ids, r.finish_reason

    assert segment("", 12) == (ids("qababab"), "repeat")  # "ab" x3 completes at token 7, which is kept
    assert segment("", 7) == (ids("qababab"), "length")  # the budget is checked before repetition
    # A continuation: "qabab" is prompt, so the whole response's loop (done at token 7) goes unseen.
    assert segment("qabab", 12) == (ids("abab") + [TOK.eos_token_id], "stop")


def test_generation_keep_trims_only_inside_the_last_segment():
    g = Generation("x", [1], 0.0)
    g.extend(1, 0, [5, 6, 7], [-1.0] * 3)
    g.extend(2, 1, [8, 9], [-2.0] * 2)
    g.keep(4)
    assert (g.response_ids, g.versions, g.segments[-1]) == (
        [5, 6, 7, 8],
        [0, 0, 0, 1],
        {"explorer_step": 2, "version": 1, "start": 3, "end": 4},
    )
    with pytest.raises(ValueError, match="outside the last segment"):
        g.keep(2)


# --------------------------------------------------------------------------- a step


def test_cut_generations_continue_with_the_new_version_and_keep_their_provenance(tmp_path):
    p, engine = make(
        tmp_path, {"a": "12", "b": "1234567", "c": "34"}, batch_size=1, repeat_times=1, segment=4, in_flight=2
    )
    writer = BufferWriter(*open_storage(str(tmp_path), {}), 0)
    b1, m1 = run_step(p, writer, 1)  # starts a and b (2 in flight): a fits one segment, b is cut after 4 tokens
    engine.version = 3  # a sync between steps
    b2, m2 = run_step(p, writer, 2)  # b continues with version 3; c is started to keep 2 in flight
    b3, m3 = run_step(p, writer, 3)  # c finished in step 2 and waited: the oldest complete group goes first
    assert [[x.task_id for x in b.experiences()] for b in (b1, b2, b3)] == [["a"], ["b"], ["c"]]
    assert (m1["started_groups"], m2["started_groups"], m3["started_groups"]) == (2, 1, 1)
    assert (m1["cut_generations"], m2["resumed_generations"], m2["pending_groups"]) == (1, 1, 1)
    assert m3["rounds"] == 1 and m3["extra_rounds"] == 0
    (b,) = b2.experiences()
    assert TOK.decode(b.response_ids, skip_special_tokens=True) == "1234567" and b.finish_reason == "stop"
    assert b.segments == [
        {"explorer_step": 1, "version": 0, "start": 0, "end": 4},
        {"explorer_step": 2, "version": 3, "start": 4, "end": 8},
    ]
    assert b.versions == [0] * 4 + [3] * 4 and b.num_segments == 2 and b.reward == 1.0 and b.explorer_step == 2
    assert [c["prompts"] for c in engine.calls] == [2, 2, 1]  # one generate call per step for every held group
    assert len({c["seed"] for c in engine.calls}) == len(engine.calls)  # every segment samples with its own seed


def test_truncated_at_max_response_tokens_and_at_the_context(tmp_path):
    p, _ = make(tmp_path, {"a": LONG}, batch_size=1, repeat_times=1, segment=4, max_response=10)
    writer = BufferWriter(*open_storage(str(tmp_path), {}), 0)
    batch, m = run_step(p, writer, 1)  # the batch is short: extra rounds in the same step finish it
    (x,) = batch.experiences()
    assert x.finish_reason == "truncated" and len(x.response_ids) == 10 and m["extra_rounds"] == 2
    # Near the context limit the segment budget shrinks to what fits.
    p2, engine2 = make(
        tmp_path / "ctx", {"a": LONG}, batch_size=1, repeat_times=1, segment=4, max_response=30, max_model_len=9
    )
    x = run_step(p2, BufferWriter(*open_storage(str(tmp_path / "ctx"), {}), 0), 1)[0].experiences()[0]
    assert x.finish_reason == "truncated" and len(x.prompt_ids) + len(x.response_ids) == 9
    # Prompt "a:" is 2 tokens: both held groups get a segment of 4 in one call; then only the
    # oldest goes on, with the 3 tokens that still fit. The second waits for the next step.
    assert [c["max_tokens"] for c in engine2.calls] == [[4, 4], [3]]
    assert [len(g.members[0].response_ids) for g in p2.groups] == [4]


def loop_row(tmp_path, answer: str, segment: int):
    """Task "a" answered by `answer` in segments of `segment` tokens, under repetition rule
    (2, 3) ("ab" x3 is a loop) and penalty -0.5: its one row, and the engine's reason for the
    last segment. A row's per-token lists match its response, which its last segment ends."""
    p, engine = make(
        tmp_path,
        {"a": answer},
        batch_size=1,
        repeat_times=1,
        segment=segment,
        max_response=30,
        repeat_ngram=2,
        repeat_threshold=3,
        repeat_penalty=-0.5,
    )
    (x,) = run_step(p, BufferWriter(*open_storage(str(tmp_path), {}), 0), 1)[
        0
    ].experiences()  # extra rounds of step 1 run every segment
    assert len(x.logprobs) == len(x.versions) == len(x.response_ids) == x.segments[-1]["end"]
    return x, engine.calls[-1]["finish_reasons"][0]


@pytest.mark.parametrize(
    "answer, segment, kept, spans, engine_said",
    [
        # The loop completes at token 7, inside the second segment; vLLM saw only "baba" and
        # ran to its budget.
        ("qabababababab", 4, "qababab", [(0, 4), (4, 7)], "length"),
        # It completes at token 12 ("qwerty" + "ab" x3), in the second segment; vLLM, seeing
        # only that segment's "ababab", says repeat 2 tokens later (as in real runs: segments
        # [0,24) and [24,32), loop complete at token 29).
        ("qwertyabababababab", 8, "qwertyababab", [(0, 8), (8, 12)], "repeat"),
        # It completes on the first token after a boundary (k = start + 1: "qwababa" + "b"),
        # vLLM's segment-local loop "bababa" 5 tokens later.
        ("qwabababababababab", 7, "qwababab", [(0, 7), (7, 8)], "repeat"),
        # It completes on the last token of a segment ("qwera" + "babab"): that segment's end
        # is checked, and the row is not continued.
        ("qwerababababab", 5, "qwerababab", [(0, 5), (5, 10)], "length"),
        # It completes at token 7; "z" and EOS follow in the same segment: vLLM says stop.
        ("qabababz", 5, "qababab", [(0, 5), (5, 7)], "stop"),
    ],
)
def test_a_loop_is_cut_where_it_first_completes_in_the_whole_response(
    tmp_path, answer, segment, kept, spans, engine_said
):
    x, said = loop_row(tmp_path, answer, segment)
    assert said == engine_said  # the segment ended as the case says (vLLM's view), whatever the row's end
    assert x.finish_reason == "repeat" and x.response_ids == ids(kept)
    assert [(s["start"], s["end"]) for s in x.segments] == spans
    base = float(x.response_text == answer)  # the reward function's score of the cut response (0)
    assert x.reward_components["repeat_penalty"] == -0.5 and x.reward == base - 0.5  # the penalty once


def test_a_stop_string_across_a_boundary_ends_the_response_before_the_engines_eos(tmp_path):
    # "##" spans the boundary of "ab#" + "#c": vLLM, with "ab#" as prompt, ran on to EOS.
    p, engine = make(tmp_path, {"a": "ab##c"}, batch_size=1, repeat_times=1, segment=3, max_response=30, stop=["##"])
    (x,) = run_step(p, BufferWriter(*open_storage(str(tmp_path), {}), 0), 1)[0].experiences()
    assert engine.calls[-1]["finish_reasons"] == ["stop"] and x.finish_reason == "stop"
    assert (
        x.response_ids == ids("ab##")
        and x.response_text == "ab"
        and [(s["start"], s["end"]) for s in x.segments] == [(0, 3), (3, 4)]
    )


def test_without_a_loop_the_engines_stop_stands(tmp_path):
    # "abab" is a loop's first 4 tokens only; the whole response never completes one.
    x, said = loop_row(tmp_path, "qababz", 4)
    assert said == "stop" and x.finish_reason == "stop"
    assert x.response_ids == ids("qababz") + [TOK.eos_token_id] and [(s["start"], s["end"]) for s in x.segments] == [
        (0, 4),
        (4, 7),
    ]
    assert "repeat_penalty" not in x.reward_components and x.reward == 1.0


def test_a_group_enters_the_buffer_only_when_every_member_finished(tmp_path):
    # Group a: one member answers at once, the other needs 3 segments; b and c finish at once.
    p, _ = make(tmp_path, {"a": ["1", "0123456789"], "b": "2", "c": "3"}, batch_size=1, repeat_times=2, segment=4)
    writer = BufferWriter(*open_storage(str(tmp_path), {}), 0)
    written = [sorted({x.task_id for x in run_step(p, writer, e)[0].experiences()}) for e in (1, 2, 3)]
    assert written == [["b"], ["c"], ["a"]]  # a waited (its finished member in the store) and came whole
    rows = {TOK.decode(x.response_ids, skip_special_tokens=True): x for x in _all_rows(tmp_path) if x.task_id == "a"}
    assert (
        set(rows) == {"1", "0123456789"}
        and rows["1"].segments[0]["explorer_step"] == 1
        and rows["1"].explorer_step == 3
    )


def test_every_group_written_once_and_nothing_lost_over_a_crash_at_each_point(tmp_path):
    answers = {f"t{i}": "z" * (1 + (7 * i) % 11) for i in range(12)}

    def steps(run, crash_at: str | None, e_crash: int):
        p, _ = make(run, answers, batch_size=2, repeat_times=2, segment=3, max_response=20)
        writer = BufferWriter(*open_storage(str(run), {}), 0)
        for e in range(1, 7):
            batch, _ = p.generate(e)
            if crash_at == "before_stage" and e == e_crash:
                return
            p.stage(e, batch)
            if crash_at == "before_commit" and e == e_crash:
                return
            writer.write(e, batch)
            if crash_at == "before_retire" and e == e_crash:
                return
            p.committed(e)

    clean = tmp_path / "clean"
    steps(clean, None, 0)
    want = _group_ids(clean)
    assert len(want) == 6 * 2 * 2  # 6 steps x 2 groups x 2 members, each row once
    for point in ("before_stage", "before_commit", "before_retire"):
        run = tmp_path / point
        steps(run, point, 4)
        first = _last_committed(run) + 1  # what a resume starts at
        p, _ = make(run, answers, first_step=first, batch_size=2, repeat_times=2, segment=3, max_response=20)
        writer = BufferWriter(*open_storage(str(run), {}), 0)
        for e in range(first, 7):
            run_step(p, writer, e)
        assert _group_ids(run) == want, point  # the same groups as without a crash, each written once
        assert not [x for x in p.store.list() if x.kind == "outbox"]


def _last_committed(run) -> int:
    return max((r["explorer_step"] for _, r in commit_records(*open_storage(str(run), {}))), default=0)


def _all_rows(run) -> list:
    fs, root = open_storage(str(run), {})
    rows = []
    for _, rec in commit_records(fs, root):
        path = join(_files.buffer_root(root), rec["path"])
        rows += _files.read_data(fs, path, size=rec["size"], checksum=_files.checksum_of(rec), uri=path).experiences()
    return rows


def _group_ids(run) -> list[str]:
    """Every committed row's group id (sorted), after checking no experience was committed twice."""
    rows = _all_rows(run)
    assert len(rows) == len({x.experience_id for x in rows})
    return sorted(x.group_id for x in rows)


def test_token_version_metrics_by_hand():
    from rl_engine.experience import Experience, ExperienceBatch
    from rl_engine.roles.trainer import token_versions

    def row(i, versions):
        return Experience(
            experience_id=f"x{i}",
            task_id="t",
            group_id="g",
            explorer_id=0,
            explorer_step=3,
            prompt_ids=[1],
            response_ids=[5] * len(versions),
            logprobs=[-1.0] * len(versions),
            versions=versions,
            loss_mask=[1] * len(versions),
            reward=0.0,
        )

    m = token_versions(ExperienceBatch.from_experiences([row(0, [0, 0, 1, 1]), row(1, [1, 1])]), trainer_version=2)
    # gaps 2, 2, 1, 1, 1, 1; two tokens older than the newest segment of their trajectory
    assert m == {
        "version_gap_mean": pytest.approx(8 / 6),
        "version_gap_max": 2,
        "tokens_older_fraction": pytest.approx(2 / 6),
    }
