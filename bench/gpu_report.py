"""The GPU check's probes and summary (bench/gpu_check.sh): environment probe, trace check, final table.

    python bench/gpu_report.py env --out OUT/env.json          # versions, device, stream priorities, NVTX
    python bench/gpu_report.py trace-check TRACE --out J.json   # a pipeline run's trace: ranks, streams, hp spans
    python bench/gpu_report.py table OUT                        # one row per step of OUT/status.tsv

`table` reads OUT/status.tsv (name, exit code, seconds, limit, log; one line per step, written by
gpu_check.sh) and each step's JSON in OUT, and prints one short row per step: status (ok, FAIL rc, TIMEOUT,
SKIP) and the step's headline numbers. It never raises on a missing or broken file: that step's row says what
is missing. Only the standard library is needed for `table`, so it works even when a step failed to import.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed


# ---- env -----------------------------------------------------------------------------------------------------
def probe_env() -> dict:
    import importlib
    import platform

    out: dict = {"python": platform.python_version(), "modules": {}}
    for mod in ("torch", "triton", "pydantic", "pydantic_core", "nvtx", "yaml", "numpy", "pytest"):
        try:
            m = importlib.import_module(mod)
            out["modules"][mod] = getattr(m, "__version__", "present")
        except Exception as err:  # noqa: BLE001 - report, never fail the probe
            out["modules"][mod] = f"MISSING ({type(err).__name__})"
    try:
        import torch
    except ImportError:
        out["cuda"] = False
        return out
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        dev = torch.device("cuda", 0)
        out["device"] = torch.cuda.get_device_name(dev)
        out["device_count"] = torch.cuda.device_count()
        out["capability"] = list(torch.cuda.get_device_capability(dev))
        out["memory_GiB"] = torch.cuda.get_device_properties(dev).total_memory / 2**30
        out["stream_priority_range"] = list(torch.cuda.Stream.priority_range())
        hp = torch.cuda.Stream(device=dev, priority=-1)
        out["hp_stream_priority"] = hp.priority
        x = torch.randn(1 << 20, device=dev)
        with torch.cuda.stream(hp):
            y = x * 2
        torch.cuda.current_stream().wait_stream(hp)
        out["hp_stream_works"] = bool(torch.allclose(y, x * 2))
        try:
            torch.cuda.nvtx.range_push("gpu_check")
            torch.cuda.nvtx.range_pop()
            out["torch_cuda_nvtx"] = "ok"
        except Exception as err:  # noqa: BLE001
            out["torch_cuda_nvtx"] = f"failed: {err}"
    try:
        from pipeline.observability import recorder

        out["recorder_nvtx"] = recorder._nvtx is not None  # the recorder emits NVTX ranges only with the package
    except Exception as err:  # noqa: BLE001
        out["recorder_nvtx"] = f"pipeline does not import: {type(err).__name__}: {err}"
    return out


# ---- trace check ---------------------------------------------------------------------------------------------
def check_trace(path: Path, ranks: int, device: str | None = None, comm: bool = True) -> dict:
    """What a run's merged trace proves: every rank recorded, hp post+res spans, comm spans (unless `comm` is
    False: a one-rank run has no P2P)."""
    from traces import Trace

    tr = Trace.load(path)
    by_stream: dict[str, int] = {}
    by_rank: dict[int, int] = {}
    kinds: dict[str, int] = {}
    for s in tr.spans:
        by_stream[s.stream] = by_stream.get(s.stream, 0) + 1
        by_rank[s.rank] = by_rank.get(s.rank, 0) + 1
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    hp = [s for s in tr.spans if s.stream == "hp"]
    problems = []
    if sorted(by_rank) != list(range(ranks)):
        problems.append(f"ranks with spans {sorted(by_rank)}, expected 0..{ranks - 1}")
    if not hp:
        problems.append("no spans on the hp stream (MLP post+res)")
    if comm and not by_stream.get("comm"):
        problems.append("no comm spans")
    if device is not None and not str(tr.meta.get("device", "")).startswith(device):
        problems.append(f"the run's device is {tr.meta.get('device')!r}, expected {device}")
    if any(s.duration < 0 for s in tr.spans):
        problems.append("negative span durations")
    return {"trace": str(path), "device": tr.meta.get("device"), "spans": len(tr.spans), "by_stream": by_stream,
            "by_rank": {str(k): v for k, v in sorted(by_rank.items())}, "kinds": kinds, "hp_spans": len(hp),
            "hp_median_us": sorted(s.duration for s in hp)[len(hp) // 2] if hp else None,
            "ok": not problems, "problems": problems}


# ---- resume check --------------------------------------------------------------------------------------------
STEP_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss ([-\d.eE+]+)", re.M)


def check_resume(full_log: Path, resumed_log: Path, rel_tol: float) -> dict:
    """An uninterrupted run's losses against those printed by a run resumed from its checkpoint: every step the
    resumed run printed must match the uninterrupted run's loss of that step (relative `rel_tol`)."""
    full = {int(k): float(v) for k, _, v in STEP_LINE.findall(full_log.read_text(errors="replace"))}
    resumed = {int(k): float(v) for k, _, v in STEP_LINE.findall(resumed_log.read_text(errors="replace"))}
    problems = []
    if not resumed:
        problems.append(f"{resumed_log.name}: no step lines")
    diffs = {}
    for k, loss in sorted(resumed.items()):
        if k not in full:
            problems.append(f"step {k} of the resumed run is not in {full_log.name}")
            continue
        diffs[k] = abs(loss - full[k]) / max(abs(full[k]), 1e-30)
        if diffs[k] > rel_tol:
            problems.append(f"step {k}: resumed loss {loss} vs uninterrupted {full[k]} (rel {diffs[k]:.2e})")
    return {"full": full, "resumed": resumed, "rel_diff": {str(k): v for k, v in diffs.items()}, "rel_tol": rel_tol,
            "ok": not problems, "problems": problems}


# ---- table ---------------------------------------------------------------------------------------------------
def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return {"_error": f"{path.name}: not valid JSON ({err})"}


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return ""
    return " | ".join(lines[-n:])


_REASON = re.compile(r"(^[A-Za-z_.]*(Error|Exception)\b.*:|\berror:|\bFAILED\b|\bTimed out\b|timed out)")


def _reason(path: Path) -> str:
    """The most telling line of a failed step's log: the last error line (not torchrun's wrapper), else the last."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return f"no log {path.name}"
    for ln in reversed(lines):
        if _REASON.search(ln) and "ChildFailedError" not in ln and not ln.startswith("+ "):
            return ln[:300]
    return lines[-1][:300] if lines else "(empty log)"


JSON_STEPS = {"fb_pair_cuda": "fb_pair.json", "hp_bitwise": "hp_bitwise.json", "multi_gpu": "multi.json"}


def _json_step(name: str, out: Path, log: Path, failed: bool) -> str:
    """Headline of a step whose script writes its checks into a JSON (also when it failed: the problems)."""
    d = _load(out / JSON_STEPS[name])
    if not d or "_error" in d:
        return _reason(log) if failed else _tail(log)
    probs = d.get("problems") or []
    if name == "fb_pair_cuda":
        tr, sh = d["trace"]["overlap"], d["shape"]
        ms = d["step_ms_median"]
        text = (f"{d['device']}, {d['backend']} ws1, 1-rank EP F/B: {sh['fb_pairs_per_step']} pairs/step threaded "
                f"(half spans F {tr['half_spans']['F']} B {tr['half_spans']['B']}, a2a comm {tr['a2a_comm_spans']}); "
                f"step overlap {ms['overlap']:.1f} vs serial {ms['serial']:.1f} ms (x{d['overlap_over_serial']:.2f}); "
                f"loss rel {d['max_loss_rel']:.0e}, grad rel {d['max_grad_rel']:.0e} (tol {d['tolerance']:.0e}, "
                f"{d['dtype']}), bitwise {d['bitwise_grads']}")
    elif name == "hp_bitwise":
        parts = []
        for v, e in d["variants"].items():
            if "error" in e:
                parts.append(f"{v} ERROR {e['error'][:80]}")
            else:
                parts.append(f"{v} {e['hp_equal']} equal (no-hp baseline {e['baseline_equal']}, hp spans "
                             f"{e['hp_spans']})")
        sh = d.get("shape", {})
        text = (f"hp vs no hp, torch.equal of loss/sends/grads ({sh.get('dtype')}, T={sh.get('T')}, C={sh.get('C')}): "
                + "; ".join(parts) + ("" if d.get("hp_stream_exists") else "; CPU: no hp stream, plumbing only"))
    else:  # multi_gpu
        c = d["counts"]
        rels = [r["max_rel"] for r in d["rows"] if r.get("max_rel") is not None]
        text = (f"N={d['gpus']}, {d['nccl_side']} vs cpu/gloo, {d['steps']} steps: {c['ok']} ok, {c['fail']} FAIL, "
                f"{c['skip']} skipped; worst loss rel {max(rels) if rels else float('nan'):.1e} (tol "
                f"{d['rel_tol']:.0e}); table in multi_table.txt")
        probs = [f"{r['schedule']} {r['layout']}: {'; '.join(r.get('problems', []))}" for r in d["rows"]
                 if r["status"] == "FAIL"]
    if probs:
        text += "; PROBLEMS: " + "; ".join(probs)[:400]
    elif failed:
        text += "; step failed: " + _reason(log)
    return text


def summary(name: str, out: Path, log: Path, failed: bool = False) -> str:
    """The headline of one step, from its JSON (or its log's last line); a failed step's error line."""
    if failed and name not in JSON_STEPS:
        return _reason(log)
    try:
        if name in JSON_STEPS:
            return _json_step(name, out, log, failed)
        if name == "env":
            e = _load(out / "env.json")
            if not e:
                return _tail(log)
            missing = [k for k, v in e["modules"].items() if str(v).startswith("MISSING")]
            dev = e.get("device", "no CUDA")
            if e.get("device_count", 1) > 1:
                dev = f"{e['device_count']} x {dev}"
            pr = e.get("stream_priority_range")
            return (f"{dev}; torch {e['modules'].get('torch')}, py {e['python']}"
                    + (f"; priorities {pr}" if pr else "") + (f"; missing {','.join(missing)}" if missing else "")
                    + f"; recorder NVTX {e.get('recorder_nvtx')}")
        if name == "kernel_tests":
            m = re.search(r"(\d+ (passed|failed)[^\n]*)", _tail(log, 3))
            return m.group(1) if m else _tail(log)
        if name == "kernel_parity":
            p = _load(out / "parity.json")
            if not p or "_error" in (p or {}):
                return _tail(log)
            worst = max(p["cases"],
                        key=lambda r: r["worst_err"] / r["tol"] if r["worst_err"] == r["worst_err"] else 1e9)
            return (f"{p['passed']} passed, {p['failed']} failed at T={worst['T']}; worst {worst['worst']} "
                    f"{worst['worst_err']:.1e} (tol {worst['tol']:.0e}, C={worst['C']} {worst['dtype']})")
        if name == "kernel_bench":
            k = _load(out / "kernels.json")
            if not k or "_error" in k:
                return _tail(log)
            tgt = [r for r in k["kernels"] if r.get("target_applies")]
            low = min(tgt, key=lambda r: r["frac_of_copy"]) if tgt else None
            ov = ", ".join(f"C={r['C']} {r['overhead_pct']:+.1f}%" for r in k["blocks"]
                           if r["block"] == "mHC fused" and "overhead_pct" in r)
            return (f"copy {k['copy_GBps']:.0f} GB/s" +
                    (f"; slowest kernel {low['kernel']} C={low['C']} {100 * low['frac_of_copy']:.0f}% of copy"
                     if low else "") + (f"; fused block overhead {ov}" if ov else ""))
        if name == "stage":
            s = _load(out / "stage.json")
            if not s or "_error" in s:
                return _tail(log)
            o, t = s["overhead"], s["targets"]
            v1 = s["variants"]["n1"]["measured"]["step_ms_median"]
            v4 = s["variants"][f"n{s['n']}"]["measured"]["step_ms_median"]
            return (f"step n=1 {v1:.1f} ms, n={s['n']} {v4:.1f} ms: overhead measured {o['measured_pct']:+.1f}%, "
                    f"predicted ({s['hardware']}) {o['predicted_pct']:+.1f}%, diff {o['diff_pp']:+.1f} pp; "
                    f"<=10%: {t['overhead_ok']}, <=2pp: {t['diff_ok']}")
        if name == "world1_nccl":
            c, r = _load(out / "world1_trace_check.json"), _load(out / "world1_resume.json")
            if not c or not r or "_error" in c or "_error" in r:
                return _tail(log)
            diff = max(r["rel_diff"].values()) if r["rel_diff"] else float("nan")
            return (f"{c['device']}: every collective, checkpoint save + resume (next loss rel diff {diff:.1e}); "
                    f"{c['spans']} spans, hp {c['hp_spans']}"
                    + ("" if c["ok"] and r["ok"] else f"; PROBLEMS: {'; '.join(c['problems'] + r['problems'])}"))
        if name == "pipeline_2rank":
            c = _load(out / "trace_check.json")
            if not c or "_error" in c:
                return _tail(log)
            streams = ", ".join(f"{k} {v}" for k, v in sorted(c["by_stream"].items()))
            steps = re.findall(r"step (\d+/\d+) .*?step_time ([\d.]+ ms)", log.read_text(errors="replace"))
            last = f"; step {steps[-1][0]} {steps[-1][1]} (host-staged, not a timing)" if steps else ""
            return (f"{c['device']}: {c['spans']} spans on ranks {list(c['by_rank'])} ({streams}); hp post+res "
                    f"spans {c['hp_spans']}{last}" + ("" if c["ok"] else f"; PROBLEMS: {'; '.join(c['problems'])}"))
    except Exception as err:  # noqa: BLE001 - a broken file must not hide the other rows
        return f"(summary failed: {type(err).__name__}: {err})"
    return _tail(log)


def status_word(rc: str) -> str:
    if rc == "skip":
        return "SKIP"
    if rc in ("124", "137"):
        return "TIMEOUT"
    return "ok" if rc == "0" else f"FAIL {rc}"


def table(out: Path) -> tuple[str, bool]:
    rows = []
    try:
        lines = (out / "status.tsv").read_text().splitlines()
    except FileNotFoundError:
        return f"no {out / 'status.tsv'}: gpu_check.sh wrote no step status", False
    for line in lines:
        parts = line.split("\t")
        if len(parts) < 5:
            continue
        name, rc, sec, limit, log = parts[:5]
        result = _tail(out / log) if rc == "skip" else summary(name, out, out / log, failed=rc != "0")
        rows.append((name, status_word(rc), sec, limit, result))
    # A skipped step did not run (budget spent, or what it needs is absent): it is reported, and it is not a failure.
    all_ok = bool(rows) and all(r[1] in ("ok", "SKIP") for r in rows)
    counts = {w: sum(1 for r in rows if r[1].split()[0] == w) for w in ("ok", "SKIP")}
    counts["failed"] = len(rows) - counts["ok"] - counts["SKIP"]
    (out / "summary.json").write_text(json.dumps({
        "ok": all_ok, "counts": counts,
        "steps": [{"step": n, "status": st, "seconds": float(sec), "limit_s": float(lim), "result": res}
                  for n, st, sec, lim, res in rows]}, indent=1) + "\n")
    w = max(len(r[0]) for r in rows) if rows else 4
    text = [f"{'step':<{w}}  {'status':<8}{'s':>6}{'limit':>6}  result"]
    for name, st, sec, limit, res in rows:
        text.append(f"{name:<{w}}  {st:<8}{float(sec):>6.0f}{limit:>6}  {res}")
    text.append(f"{counts['ok']} ok, {counts['failed']} failed, {counts['SKIP']} skipped of {len(rows)} steps")
    return "\n".join(text), all_ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env", help="probe the environment")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("trace-check", help="check a pipeline run's merged trace")
    p.add_argument("trace", type=Path)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default=None, help="expected device type of the run (cpu or cuda)")
    p.add_argument("--no-comm", action="store_true", help="a run without P2P (one rank): no comm spans expected")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("resume-check", help="losses of a resumed run against an uninterrupted one")
    p.add_argument("full_log", type=Path)
    p.add_argument("resumed_log", type=Path)
    p.add_argument("--rel-tol", type=float, default=1e-5)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("table", help="print the final table of a gpu_check.sh output folder")
    p.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "env":
        env = probe_env()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(env, indent=1) + "\n")
        print(json.dumps(env, indent=1))
        missing = [k for k, v in env["modules"].items() if str(v).startswith("MISSING")]
        return 1 if missing else 0
    if args.cmd == "trace-check":
        res = check_trace(args.trace, args.ranks, args.device, comm=not args.no_comm)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
        return 0 if res["ok"] else 1
    if args.cmd == "resume-check":
        res = check_resume(args.full_log, args.resumed_log, args.rel_tol)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
        return 0 if res["ok"] else 1
    text, ok = table(args.out)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
