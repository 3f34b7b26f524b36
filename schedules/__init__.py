"""Pipeline schedules as data: IR, generators, lowering of P2P, validation, simulation, torch CSV interop."""
from schedules.build import GENERATORS, build
from schedules.durations import Durations
from schedules.ir import Action, Kind, Schedule
from schedules.lowering import lower_comms
from schedules.simulate import SimResult, peak_live_activations, simulate
from schedules.validate import ScheduleError, validate_schedule

__all__ = ["GENERATORS", "Action", "Durations", "Kind", "Schedule", "ScheduleError", "SimResult", "build",
           "lower_comms", "peak_live_activations", "simulate", "validate_schedule"]
