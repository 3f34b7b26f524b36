"""Fitting a hardware spec's efficiencies to a measured trace (costmodel.fitting.roofline_fit through
trace_fit.fit_trace,
`mhcpipe calibrate --from-trace`)."""
import json

import yaml

from costmodel.physics.hardware import HardwareSpec, get_hardware
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.answers.predict import predict
from costmodel.fitting.roofline_fit import priced_action_us, scaled_hardware
from costmodel.fitting.trace_fit import measured_action_us
from mhcpipe.cli import main as mhcpipe_main


def calibrate_main(argv: list[str]) -> int:
    return mhcpipe_main(["calibrate", *argv])


def _traced_run(cfg, hw, spec):
    """A 'measured' trace: the run priced on a machine whose efficiencies we know."""
    pred = predict(cfg, hw, spec, ladder=False)
    trace = pred.mhc.trace
    trace.meta.update({"source": "measured", "model": cfg.model.name,
                       "residual": {"variant": spec.variant, "n": spec.n}})
    return trace


def test_fit_recovers_the_machine_and_the_profile_predicts(small_cfg, tmp_path, capsys):
    base_cfg = small_cfg.with_residual("residual", 1)
    h800 = get_hardware("h800")
    machine = scaled_hardware(h800, matrix=0.6, memory=0.8)
    trace_path = tmp_path / "trace.json"
    _traced_run(base_cfg, machine, ResidualSpec.baseline()).save(trace_path)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(json.loads(small_cfg.model_dump_json())))
    out = tmp_path / "fitted.json"

    assert calibrate_main(["--from-trace", str(trace_path), "--config", str(cfg_path), "--hardware", "h800",
                           "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "median |error| before" in printed and f"wrote {out}" in printed
    fitted = HardwareSpec.load(out)
    scales = fitted.meta["fit_scales"]
    assert abs(scales["matrix"] / 0.6 - 1) < 0.05 and abs(scales["memory"] / 0.8 - 1) < 0.05, scales
    measured = measured_action_us(_traced_run(base_cfg, machine, ResidualSpec.baseline()))
    for hw, worst in ((h800, None), (fitted, 0.02)):
        priced = priced_action_us(base_cfg, hw, measured, ResidualSpec.baseline())
        err = max(abs(priced[k] / measured[k] - 1) for k in measured)
        assert (err > 0.2) if worst is None else (err < worst), (hw.name, err)

    # the fitted profile predicts mHC: closer to the machine's mHC step than the unfitted spec
    assert mhcpipe_main(["predict", "--config", str(cfg_path), "--hardware", str(out)]) == 0
    truth = predict(small_cfg, machine, ladder=False).mhc.makespan
    with_fit = predict(small_cfg, fitted, ladder=False).mhc.makespan
    without = predict(small_cfg, h800, ladder=False).mhc.makespan
    assert abs(with_fit / truth - 1) < 0.02 < abs(without / truth - 1)


def test_fit_refuses_the_mhc_run_and_another_model(small_cfg, tmp_path, capsys):
    mhc_trace = tmp_path / "mhc.json"
    _traced_run(small_cfg, get_hardware("h800"), ResidualSpec("mhc", 4)).save(mhc_trace)
    other = tmp_path / "other.json"
    _traced_run(small_cfg.with_residual("residual", 1), get_hardware("h800"), ResidualSpec.baseline()).save(other)
    for argv, words in ((["--from-trace", str(mhc_trace), "--preset", "paper-3b"], "baseline"),
                        (["--from-trace", str(other), "--preset", "tiny"], "model"),
                        (["--from-trace", str(other)], "--preset NAME or --config"),
                        (["--from-trace", str(tmp_path / "none.json"), "--preset", "tiny"], "none.json")):
        assert calibrate_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
