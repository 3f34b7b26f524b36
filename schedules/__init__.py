"""Pipeline schedules as data: IR, generators, lowering of P2P, validation, simulation, torch CSV interop.

Modules: `ir` (Action, Kind, Schedule), `registry` (every kind's generator and facts: the one list of schedule
names), `build`, the generators (`gpipe`, `one_f_one_b`, `zb1p`, `dualpipe`, `dualpipev`, with `_eight_steps`
shared by the DualPipes and `_checks`), `lowering` (P2P actions), `deps` (the dependency semantics), `graph`
(networkx), `validate`, `engine` (the event engine), `replay` (a completed schedule rerun with new prices from
the engine's order), `memo` (what is derived from one schedule object, once),
`simulate`, `durations`, `formulas` (closed-form bubbles and peaks), `torch_csv` (torch.distributed.pipelining's
CSV), `ir_json`.
"""
from schedules.build import build
from schedules.durations import Durations
from schedules.ir import Action, Kind, Schedule
from schedules.registry import ScheduleKind, kind_of, names, register
from schedules.lowering import lower_comms
from schedules.simulate import SimResult, peak_live_activations, simulate
from schedules.validate import ScheduleError, validate_schedule

__all__ = ["Action", "Durations", "Kind", "Schedule", "ScheduleError", "ScheduleKind", "SimResult", "build",
           "kind_of", "lower_comms", "names", "peak_live_activations", "register", "simulate", "validate_schedule"]
