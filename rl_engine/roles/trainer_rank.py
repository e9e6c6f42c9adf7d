"""One trainer rank, as torchrun starts it: rank 0 runs the trainer role, the others follow it.

The trainer role starts these itself when `trainer.num_ranks` > 1 (`rl_engine.trainer.launch`);
by hand, on one machine:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m rl_engine.roles.trainer_rank runs/my-run
"""

from __future__ import annotations

import argparse
import os

from torch.distributed.elastic.multiprocessing.errors import record

from rl_engine.storage import add_storage_options_arg, parse_storage_options


@record  # a rank's exception reaches torchrun's failure summary (and so the role's error)
def main(argv: list[str] | None = None) -> None:
    from rl_engine.proc.owner_watch import start_owner_watch
    from rl_engine.run.context import open_run

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_url", help="the run's directory or URL")
    add_storage_options_arg(p)
    args = p.parse_args(argv)
    start_owner_watch()  # the trainer role that started torchrun is gone: so are we
    if int(os.environ["RANK"]) == 0:
        from rl_engine.roles.entry import trainer_loop

        trainer_loop(open_run(args.run_url, parse_storage_options(args.storage_options)))
    else:
        from rl_engine.trainer import trainer_settings
        from rl_engine.trainer.deepspeed_trainer import DeepSpeedTrainer
        from rl_engine.trainer.ranks import follow

        run = open_run(args.run_url, parse_storage_options(args.storage_options))
        follow(DeepSpeedTrainer(trainer_settings(run.cfg)), run.storage_options)  # the settings rank 0's role builds
    import torch.distributed as dist

    if dist.is_initialized():  # left to interpreter exit, gloo's threads can abort the rank (pytorch/pytorch#190489)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
