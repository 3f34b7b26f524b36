"""gpu_check's first step: do the runtime's own streams follow the rule the pipeline relies on? A kernel on the
compute stream (the legacy default stream) must run while an end stream waits for an op that has not completed
(docs/cuda_program.md, rule 2). With blocking end streams (cudaStreamCreate) it waits for that op instead, and
the first NCCL launch deadlocks at step 1.

    python bench/gpu_stream_probe.py --device cuda [--out probe.json]
    python bench/gpu_stream_probe.py --device cpu  [--out probe.json]

cuda: the op that has not completed is a long chain of matmuls on another stream (about 1 s); the end stream is
made by the runtime's device layer (pipeline.device.cuda.CudaDevice.new_stream, as pipeline.distributed.comm makes
it) and waits for that chain's event; then a small kernel goes to the compute stream and its event is polled. ok:
it completed while the chain was still running. The control repeats it with a blocking stream, which must fail
(if it does not, the probe cannot tell and says so).
cpu: the emulated device records the stream flags the runtime's Comms asks for; the documented two-rank 1F1B
example (docs/examples/cuda_program) is rebuilt with those flags and replayed under CUDA's rules: ok with the
runtime's flags, a deadlock with blocking ones (the control).
Prints one line (`stream probe: ok ...` or `stream probe: FAIL ...`), exit 0 / 1.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def probe_cuda(blocking: bool) -> dict:
    import torch

    from pipeline.device.cuda import CudaDevice

    dev = CudaDevice(torch.device("cuda", torch.cuda.current_device()))
    busy = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):  # the "op that has not completed": about a second of matmuls
        t0 = time.perf_counter()
        x = a
        for _ in range(400):
            x = x @ a
            x = x / x.norm()
        pending = torch.cuda.Event()
        pending.record(busy)
    end = dev.new_stream("end", blocking=blocking)
    end.wait_event(pending)
    y = torch.ones(16, device="cuda") * 2  # a kernel on the compute (legacy default) stream
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        time.sleep(1e-4)
    seen = time.perf_counter() - t0
    ran_first = not pending.query()
    torch.cuda.synchronize()
    chain = time.perf_counter() - t0
    return {"blocking": blocking, "compute_done_s": round(seen, 4), "chain_s": round(chain, 4),
            "compute_ran_while_pending": ran_first, "check": float(y.sum())}


def probe_cpu(blocking: bool) -> dict:
    from pipeline.device.emulated import EmulatedCuda
    from pipeline.distributed.comm import Comms
    from pipeline.observability.recorder import Recorder
    from traces.analysis.cuda_replay import replay_programs
    from traces.formats.cuda_program import Program

    import torch

    dev = EmulatedCuda(0, 1, 5.0)
    Comms(0, Recorder(0, torch.device("cpu"), enabled=False), 5.0, stream_ordered=True, dev=dev)
    flags = {s for s in dev.stream_flags.values()}
    used = "blocking" if blocking else (flags.pop() if len(flags) == 1 else "mixed")
    spec = importlib.util.spec_from_file_location("make_example", ROOT / "docs/examples/cuda_program/make_example.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    progs = [Program(r, 2, p, f"rank{r}") for r, p in enumerate((mod.rank0(used), mod.rank1(used)))]
    res = replay_programs(progs)
    dev.close()
    return {"blocking": blocking, "flags": used, "compute_ran_while_pending": res.ok, "replay": res.summary()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    probe = probe_cuda if args.device == "cuda" else probe_cpu
    runtime, control = probe(False), probe(True)
    ok = runtime["compute_ran_while_pending"]
    discriminates = not control["compute_ran_while_pending"]
    out = {"device": args.device, "ok": ok, "control_fails": discriminates, "runtime": runtime, "control": control}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    if not ok:
        print("stream probe: FAIL: a compute-stream kernel waited for an end stream's pending op (the runtime's "
              f"streams block the legacy default stream): {runtime}")
        return 1
    note = "" if discriminates else " (the blocking-stream control did not fail: the probe cannot tell here)"
    print(f"stream probe: ok: the compute stream ran while an end stream waited for a pending op{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
