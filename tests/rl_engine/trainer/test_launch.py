"""rl_engine.trainer.launch: torchrun's failure summary becomes one line naming the rank.

.venv/bin/python -m pytest tests/rl_engine/trainer/test_launch.py
"""

from __future__ import annotations

from rl_engine.trainer.launch import describe_failure

# torchrun 2.13's summary when rank 1 raised (rank_main's @record) and rank 0 was stopped after it.
RAISED = """\
Failures:
[1]:
  time      : 2026-11-24_23:59:16
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 15568)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 15568
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_23:59:16
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 15569)
  error_file: /tmp/torchelastic_x/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "/tmp/fail_rank.py", line 6, in main
      raise ValueError("batch of 5 rows does not split")
  ValueError: batch of 5 rows does not split

============================================================
"""


def test_a_raising_rank_is_named_with_its_exception():
    assert (
        describe_failure(RAISED, 1) == "trainer rank 1 (pid 15569) failed: ValueError: batch of 5 rows does not split"
    )


def test_a_killed_rank_is_named_with_its_signal():
    killed = (
        RAISED.split("Root Cause")[0]
        + "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 77)\n  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 77\n=====\n"
    )
    assert describe_failure(killed, 1) == "trainer rank 1 (pid 77) failed: Signal 9 (SIGKILL) received by PID 77"


def test_output_without_a_summary_still_says_what_happened():
    assert (
        describe_failure("Killed\n", 137) == "the trainer's ranks (torchrun) exited with code 137; see the output above"
    )


# torchrun 2.13's summary (CI) when rank 1 was SIGKILLed in the middle of an all-reduce: rank 0's gloo
# call failed at once, so torchrun's first observed failure is rank 0's exception (then its SIGTERM);
# the kill is what the run must be told about.
PEER_FAILED_FIRST = """\
Failures:
[0]:
  time      : 2026-11-25_01:09:05
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 16187)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 16187
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-11-25_01:09:04
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 16186)  (SIGTERM)
  error_file: /tmp/torchelastic_4sm3odlp/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "/tmp/cicheck/main/rl_engine/trainer/ranks.py", line 103, in train_step
  RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:24978: Connection reset by peer.
============================================================
"""


def test_a_killed_rank_is_named_even_when_its_peer_failed_first():
    assert (
        describe_failure(PEER_FAILED_FIRST, 1)
        == "trainer rank 1 (pid 16187) failed: Signal 9 (SIGKILL) received by PID 16187"
    )
