"""Suite-wide: every pipeline run the tests launch (mhcpipe run, torchrun -m pipeline, the demo) uses the strict
transport unless a test says otherwise, so a posting order that would hang on NCCL fails here
(pipeline.distributed.strict_transport). Workers that build configs in-process set train.comm_rules themselves
(tests/pipeline/_pipeline_helpers.tiny_config).

`make test` runs two pytest-xdist workers. The modules in RANKS_MODULES start several processes that keep every
core busy (the rank pool of tests/rank_pool.py, torchrun, `mhcpipe run`, the demo): their tests carry the marker
`ranks` and xdist hands all of them to one worker, one at a time, while the other worker runs the single-process
tests (tests/README.md). A module that uses the rank pool must be listed here; collection says so otherwise."""
import os

import pytest

os.environ.setdefault("MHCPIPE_COMM_RULES", "nccl")  # every launch under NCCL's rules (docs/communication.md)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers (and the rank processes beside them) share the cores: one compute thread each, or torch's
    # OpenMP threads spin on cores that other processes need
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

RANKS_MODULES = frozenset({
    "tests/bench/test_bench_torch_dualpipev.py",
    "tests/pipeline/test_check_split.py",
    "tests/pipeline/test_pipeline_checkpoint.py",
    "tests/pipeline/test_pipeline_cli.py",
    "tests/pipeline/test_pipeline_collective.py",
    "tests/pipeline/test_stage_split_runtime.py",
    "tests/pipeline/test_pipeline_cuda_emulation.py",
    "tests/pipeline/test_emulated_launch.py",
    "tests/pipeline/test_pipeline_demo.py",
    "tests/pipeline/test_pipeline_equivalence.py",
    "tests/pipeline/test_pipeline_faults.py",
    "tests/pipeline/test_pipeline_interleaved.py",
    "tests/pipeline/test_pipeline_layout.py",
    "tests/pipeline/test_pipeline_nccl_rules.py",
    "tests/pipeline/test_pipeline_overlap.py",
    "tests/pipeline/test_pipeline_residual_cli.py",
    "tests/pipeline/test_pipeline_wider_residuals.py",
    "tests/pipeline/test_tied_parameters.py",
    "tests/pipeline/test_long_run_faults.py",
    "tests/pipeline/test_user_model_cli.py",
    "tests/traces/test_traces_path_measured.py",
})


def _module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = _module_path(item.nodeid)
        if path in RANKS_MODULES:
            item.add_marker(pytest.mark.ranks)
        elif getattr(getattr(getattr(item, "module", None), "launch", None), "__module__", None) == "rank_pool":
            raise pytest.UsageError(f"{path} launches rank processes (rank_pool.launch): add it to "
                                    "RANKS_MODULES in tests/conftest.py")


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # plain pytest: nothing to schedule
    pass
else:
    class _RanksOnOneWorker(LoadScopeScheduling):
        """xdist's scope scheduling with one scope for every test of RANKS_MODULES (so one worker runs them, one
        after another) and a scope of its own for every other test (spread over the workers)."""

        def _split_scope(self, nodeid: str) -> str:
            return "ranks" if _module_path(nodeid) in RANKS_MODULES else nodeid

    def pytest_xdist_make_scheduler(config, log):
        return _RanksOnOneWorker(config, log)
