"""torch.distributed.pipelining CSV interop and our JSON form of the IR."""
import pytest

from schedules import names, build, lower_comms, validate_schedule
from schedules.ir_json import load_schedule, save_schedule
from schedules.torch_csv import read_csv, write_csv


@pytest.mark.parametrize("kind", names())
@pytest.mark.parametrize("lowered", [False, True])
def test_csv_round_trip(tmp_path, kind, lowered):
    s = build(kind, 4, 8)
    if lowered:
        s = lower_comms(s)
    path = write_csv(s, tmp_path / "s.csv")
    back = read_csv(path, kind="dualpipe" if kind == "dualpipe" else None)
    assert back.actions == s.actions
    assert back.stage_to_rank == s.stage_to_rank and back.pipelines == s.pipelines
    validate_schedule(back)


@pytest.mark.parametrize("kind", ["1f1b", "dualpipev", "zb1p"])
def test_every_cell_parses_with_torch(tmp_path, kind):
    """torch's own parser reads every cell we write and prints it back identically."""
    from torch.distributed.pipelining.schedules import _Action

    path = write_csv(lower_comms(build(kind, 4, 8)), tmp_path / "s.csv")
    cells = [c for line in path.read_text().splitlines() for c in line.split(",") if c]
    assert cells
    for cell in cells:
        assert str(_Action.from_str(cell)) == cell


def test_torch_comms_convention(tmp_path):
    """torch labels RECV_F with the consumer's stage; our IR with the producer's."""
    path = write_csv(lower_comms(build("1f1b", 2, 2)), tmp_path / "s.csv")
    rank1 = path.read_text().splitlines()[1].split(",")
    assert "1RECV_F0" in rank1 and "1SEND_B0" in rank1
    rank0 = path.read_text().splitlines()[0].split(",")
    assert "0SEND_F0" in rank0 and "0RECV_B0" in rank0


@pytest.mark.parametrize("text, match", [
    ("0F0,0BW0\n", "pre-2.6 torch spelling"),
    ("0F0,0UNSHARD\n", "FSDP"),
    ("0F0,0X0\n", "cannot read action"),
    ("", "empty schedule"),
])
def test_bad_csv(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_csv(path)


def test_json_round_trip_and_errors(tmp_path):
    s = lower_comms(build("dualpipe", 4, 8))
    back = load_schedule(save_schedule(s, tmp_path / "s.json"))
    assert back == s
    (tmp_path / "t.json").write_text(save_schedule(s, tmp_path / "s.json").read_text()[:50])
    with pytest.raises(ValueError, match="truncated"):
        load_schedule(tmp_path / "t.json")
    (tmp_path / "u.json").write_text('{"format": "mhc-pipe-schedule", "version": 1, "kind": "x"}')
    with pytest.raises(ValueError, match="num_ranks"):
        load_schedule(tmp_path / "u.json")
