"""Your own model through mhc-pipe: the names a user's script imports.

    from mhcpipe.user import UserModel, run

    def build(seq_len: int = 32) -> UserModel:
        return UserModel(embed=..., blocks=[...], head=..., loss=..., n=4, hidden=64, vocab_size=256)

    if __name__ == "__main__":
        run(build)      # torchrun --nproc-per-node 4 my_model.py --schedule dualpipev --trace-dir runs/mine

The contract of each piece: pipeline.user_model; a block whose linear layers are `DeferLinear` (bias-free, like
nn.Linear(bias=False)) gets the B/W split of ZB1P and DualPipe; `StatePart` declares a tensor a model carries
beside the streams (UserModel.extra_state); the run flags are `mhcpipe run`'s (`--help`); the
check that the split computes what the unsplit model does: `mhcpipe check-split my_model.py:build`.
"""
from __future__ import annotations

import os
import sys

from pipeline.launch.entry import main
from pipeline.user_model import ContractError, StatePart, UserModel
from pipeline.weight_grad import DeferLinear

__all__ = ["UserModel", "StatePart", "ContractError", "DeferLinear", "run", "main"]


def run(build, argv: list[str] | None = None) -> None:
    """Train the model `build` makes under torchrun with the run flags of the command line; exits the process
    (without interpreter finalization, as `python -m pipeline` does: a loaded host can abort it after the run)."""
    code = main(argv, build=build)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
