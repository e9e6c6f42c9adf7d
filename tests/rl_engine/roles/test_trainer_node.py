"""rl_engine.roles.trainer_node (`rft trainer-node`): a node started before its run says so, in one line.

.venv/bin/python -m pytest tests/rl_engine/roles/test_trainer_node.py
"""

from __future__ import annotations


def test_trainer_node_without_a_run_says_to_start_the_run_first(tmp_path, capsys):
    from cli.main import main as rft

    assert rft(["trainer-node", str(tmp_path / "no-run"), "--node-rank", "1", "--wait-s", "0"]) == 2
    err = capsys.readouterr().err
    assert "no run there after 0 s" in err and "start the run first" in err and "Traceback" not in err
