"""torchrun entry: `torchrun --nproc-per-node 4 -m pipeline --config configs/tiny.yaml --schedule dualpipev
--trace-dir runs/x` (the body, shared with a user's own script: pipeline.launch.entry)."""
from __future__ import annotations

import os
import sys

from pipeline.launch.entry import add_run_arguments, main, report_flight_recorder

__all__ = ["add_run_arguments", "main", "report_flight_recorder"]

if __name__ == "__main__":
    code = main()
    # Skip interpreter finalization: on a loaded host it can abort a rank ("terminate called without an active
    # exception") after destroy_process_group has returned and the run has written everything; torchrun would
    # then report the whole run failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
