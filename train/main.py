"""The training application that torchrun (or plain python) launches; installed, it is `mingpt-train`.

    python train/main.py                                        # one process
    torchrun --standalone --nproc-per-node=2 train/main.py       # one node
    python train/main.py model=gpt-mini trainer.max_steps=2000   # any key of mingpt.training.config.Config

The application is mingpt.cli.train; its Hydra configs are conf/ beside this file. See docs/launching.md
for multinode and SLURM launching.
"""

from mingpt.cli.train import main

if __name__ == "__main__":
    main()
