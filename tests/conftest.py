"""Suite-wide: every pipeline run the tests launch (mhcpipe run, torchrun -m pipeline, the demo) uses the strict
transport unless a test says otherwise, so a posting order that would hang on NCCL fails here
(pipeline.strict_transport). Workers that build configs in-process set train.comm_rules themselves
(tests/pipeline/_pipeline_helpers.tiny_config)."""
import os

os.environ.setdefault("MHCPIPE_TRANSPORT", "strict")
