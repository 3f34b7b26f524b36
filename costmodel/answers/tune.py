"""`tune`: search the parallel layout of a run under a per-GPU memory budget and a fixed global batch, and keep the
Pareto front of step time against peak memory per GPU.

Shape letters: G global batch (sequences per step), b micro-batch size (sequences), M = G / b micro-batches of the
step, P pipeline ranks, D data-parallel replicas (P x D = the GPUs), EP expert-parallel degree, M / D the
micro-batches one pipeline runs, L_r the recompute block (sub-layers).

Search space (costmodel/answers/tune_space.py, one `Candidate` each): P dividing the GPUs (D = GPUs / P), schedule
kind, EP dividing D and the expert count (the runtime's rules, pipeline/distributed/layout.py), b from a list (M
follows), recompute off / auto (Eq. 20 per stage) / a few block sizes, the MLP-side post+res on the high-priority
stream or not, and stages that do not divide the blocks (parallel.uneven_stages: the runtime's split, the first
stages one block more), the optimizer state whole on every rank or sharded over the data-parallel ranks
(train.distributed_optimizer, ZeRO-1 as Megatron-LM's distributed optimizer: memory only; the step prices the same
gradient all-reduce). EP placement follows the runtime's mesh (data_parallel.fewest_ep_ranks_per_node ->
Options.ep_per_node). Invalid layouts (a schedule's M/P rules, too few blocks, D not dividing M) are dropped before
anything is priced.

Objective: step = the simulated pipeline of one replica (the same Pricer + simulation as `predict`'s mHC run)
plus the exposed part of the gradient all-reduce over the replicas (data_parallel.grad_sync). Memory: the peak
per rank of predict's model (memory.rank_memory: model states as Megatron counts them, with the layout's D for
the distributed optimizer, and the GPU reserve).

Ties: the model's error is a few percent (costmodel.md §1: the published analytic and simulation anchors report
2-8% average error), so layouts whose step is within TIE_PCT = 2.0% of the best are not told apart by it: the
runnable (hp) Pareto front's layouts within that band are reported as ties, most memory headroom (budget minus
peak memory) first (TuneResult.ties). Exact under the pruning below: a layout bounded out is dominated by a
simulated one with no more memory and no longer step, which is in the band too and has at least its headroom.

Pruning, exact for the front: (1) recompute choices that give every stage the same L_r as an earlier choice
are one layout; (2) memory first, from the stage memory and the schedule's peak live chunks in program order, no
simulation; (3) a lower bound on the step: per rank, the upstream forwards and sends its first action waits for
(schedules.deps.first_forward_chains), its summed action durations (F&B pairs priced with their inputs on time; a
rank runs its actions one after another) and what must follow its last action, the longer of the all-reduce that
action posts and the upstream backwards (and sends) waiting for its input gradient (schedules.deps.
last_backward_chains: 1F1B's drain), the largest over the ranks.
Candidates are visited in increasing bound; one is simulated only if no simulated layout with at most its memory
is at least as fast as its bound (first the bound priced without recompute, which adds kernels only and is shared
by the recompute choices, then the exact one; before both, the same bound with each action's floor, fb_overlap.
floor, which runs no streams: a layout it prunes is never priced, and the visits stay in cheap-bound order, see
tune()). hp-off layouts never bound out hp layouts, so the best runnable layout is exact too. Action prices are
shared between candidates whose stages hold the same blocks (SharedPricer).

Computed once and reused (Tuner): each schedule built per (kind, P, M), its programs as chunk events for memory,
checked and lowered only when one of its layouts is simulated; a layout's memory once for it and its hp twin (the
stream weighs nothing), from its stages' memory terms without a pricer (most layouts are over the budget: only
bounded and simulated ones build one), the terms once per (shape, recompute choice, dense and MoE blocks, ends);
the balanced split's piece costs once per per-op shape; a simulated layout's pricer is its exact bound's; a
simulation once per set of prices the engine reads (Tuner._simulate_key: an optimizer-sharding twin, or an hp twin
of a schedule without F&B pairs whose prices the stream leaves alone, reuses the run), and from a schedule's second
simulation on, the engine's order of its first replayed with the new prices (schedules.replay: ~4x faster, the same
numbers).
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field, replace

from costmodel.pricing.data_parallel import fewest_ep_ranks_per_node, grad_sync, reductions, sync_floor
from costmodel.physics.hardware import HardwareSpec
from costmodel.physics.memory import StageMemory, activation_peak, program_events, rank_memories
from costmodel.physics.ops import Shape
from costmodel.pricing.shared_pricer import SharedPricer, shared_stage_memories
from costmodel.pricing.options import Options
from costmodel.pricing.stage_split import balanced_split, piece_costs, resolve_layout
from costmodel.answers.predict import residual_spec_of
from costmodel.answers.tune_front import GIB, Evaluated, pareto, ties_of
from costmodel.answers.tune_space import Candidate, candidates, reference_candidate
from configs import RecomputeConfig, RunConfig, parse_config
from schedules.build import build
from schedules.deps import first_forward_chains, last_backward_chains
from schedules.ir import Action, Kind, Schedule
from schedules.memo import derived
from schedules.simulate import SimResult
from schedules.validate import check_structure

@dataclass
class TuneResult:
    front: list[Evaluated]  # Pareto front, fastest first
    best: Evaluated | None  # fastest that fits and the runtime can run (hp on); None: nothing fits
    reference: Evaluated | None  # the config's own layout on these GPUs (None: not in the space; not
    # simulated when over the budget)
    counts: Counter = field(default_factory=Counter)  # what happened to the candidates
    smallest: Evaluated | None = None  # the least memory of any layout (for the error message)
    tuner: "Tuner | None" = None  # its configs and caches
    ties: list[Evaluated] = field(default_factory=list)  # runnable front within TIE_PCT of best, most headroom
    # first (the best among them)


def merged(data: dict, over: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for section, values in over.items():
        out[section] = {**(out.get(section) or {}), **values}
    return out


def replica_config(cfg: RunConfig) -> RunConfig:
    """The one pipeline `predict` prices: one data-parallel replica running M / D micro-batches (predict builds
    its schedule from parallel.microbatches, as if data_parallel were 1)."""
    p = cfg.parallel
    par = p.model_copy(update={"data_parallel": 1, "microbatches": p.microbatches_per_replica})
    return cfg.model_copy(update={"parallel": par})


def options_of(cand: Candidate, hw: HardwareSpec, base: Options | None = None) -> Options:
    return replace(base or Options(), hp_stream=cand.hp, allow_uneven=cand.uneven, split=cand.split,
                   data_parallel=cand.dp,
                   ep_per_node=fewest_ep_ranks_per_node(cand.pp, cand.dp, cand.ep, hw.gpus_per_node))


class Tuner:
    """Prices candidates of one base config on one hardware spec (caches shared across candidates)."""

    def __init__(self, cfg: RunConfig, data: dict, hw: HardwareSpec, options: Options | None = None):
        if hw.runtime is not None or hw.host_cores:  # per-shape profiles, core sharing that depends on the layout
            raise ValueError(f"--hardware {hw.name}: a CPU spec of ranks sharing this host's cores (priced per "
                             "calibrated shape); the tuner compares layouts of GPUs: use a GPU spec such as h800")
        self.cfg, self.data, self.hw, self.base_opts = cfg, data, hw, options or Options()
        self.spec = residual_spec_of(cfg)
        self.built: dict[tuple, Schedule] = {}  # (kind, P, M) -> a schedule candidates() built, not yet used
        self._schedules: dict[tuple, tuple[Schedule, list[Counter]]] = {}
        self._events: dict[tuple, list] = {}  # (kind, P, M) -> each rank's program as chunk events
        self._lowered: dict[tuple, Schedule] = {}  # (kind, P, M) -> the schedule checked and lowered
        self._peak_cache: dict[tuple, list] = {}  # (program, stage weights) -> activation peak per rank
        self._cuts: dict[tuple, list[int]] = {}  # (kind, P, b, EP) -> blocks per stage of the balanced split
        self._pieces: dict[Shape, tuple] = {}  # the per-op shape -> stage_split.piece_costs
        self._prices: dict[tuple, tuple] = {}  # SharedPricer's
        self._staged: dict[Candidate, tuple] = {}  # cand -> its replica config, layout and stages' memory
        self._prepared: dict[Candidate, tuple] = {}  # cand -> its replica config, layout and pricer
        self._hp: dict[Candidate, Candidate] = {}  # cand -> its hp twin (memory and L_r do not depend on the stream)
        self._memory: dict[Candidate, float] = {}  # hp twin -> its peak memory per GPU (bytes)
        self._floors: dict[tuple, dict[int, float]] = {}  # bound's sync_floor per (schedule, D, EP, layout, params)
        self._sims: dict[tuple, SimResult] = {}  # simulate_key -> the simulation (record=False)
        self._bounds: dict[tuple, float] = {}  # (the candidate whose pricer a bound used, floors?) -> the bound
        self._sections: dict[tuple, tuple] = {}  # (recompute, optimizer sharding) -> those config sections
        self._pars: dict[tuple, tuple] = {}  # parallel layout -> (its parallel section, its replica's)

    def config(self, cand: Candidate) -> RunConfig:
        """The full run config of a candidate, validated (what the YAML holds)."""
        return parse_config(self.written(cand), f"layout {cand.label()}")

    def written(self, cand: Candidate) -> dict:
        """The config mapping of a candidate (what `tune -o` writes): a balanced candidate carries the cut its
        pricing used as parallel.stage_split, so `mhcpipe run` trains it and `predict --config` prices it."""
        data = merged(self.data, cand.overrides())
        if cand.split == "balanced":
            schedule, _ = self._schedule(cand)
            layout = self._stages(cand)[1]
            data["parallel"]["stage_split"] = [len(layout[st][0]) for st in schedule.pipelines[0]]
        else:
            data["parallel"].pop("stage_split", None)
        return data

    def _fast_config(self, cand: Candidate) -> RunConfig:
        """The same config without validation (candidates() applied the rules; validating builds the schedule
        again, which thousands of candidates cannot afford)."""
        return self._with(cand, self._parallels(cand)[0])

    def _with(self, cand: Candidate, parallel) -> RunConfig:
        """The base config with `parallel` and the candidate's recompute choice and optimizer sharding (each of
        those sections made once per value: a search copies the config ~10^4 times)."""
        over = cand.overrides()
        key = (cand.recompute, cand.distributed_optimizer)
        sections = self._sections.get(key)
        if sections is None:
            sections = self._sections[key] = (RecomputeConfig(**over["recompute"]),
                                              self.cfg.train.model_copy(update=over["train"]))
        return self.cfg.model_copy(update={"parallel": parallel, "recompute": sections[0], "train": sections[1]})

    def _parallels(self, cand: Candidate) -> tuple:
        """(the candidate's parallel section, its replica's: replica_config's), once per parallel layout."""
        key = _parallel_key(cand)
        got = self._pars.get(key)
        if got is None:
            full = self.cfg.parallel.model_copy(update=cand.overrides()["parallel"])
            got = self._pars[key] = (full, replica_config(self.cfg.model_copy(update={"parallel": full})).parallel)
        return got

    def _schedule(self, cand: Candidate):
        key = (cand.schedule, cand.pp, cand.per_replica)
        if key not in self._schedules:
            s = self.built.pop(key, None) or build(*key)
            per_rank = [Counter((a.kind, a.stage, a.b_stage) for a in acts) for acts in s.actions]
            self._schedules[key] = (s, per_rank)
        return self._schedules[key]

    def _program_events(self, cand: Candidate) -> list:
        """Each rank's program as chunk events (what every memory estimate of the schedule walks), cached per
        (kind, P, M)."""
        key = (cand.schedule, cand.pp, cand.per_replica)
        got = self._events.get(key)
        if got is None:
            got = self._events[key] = [program_events(acts) for acts in self._schedule(cand)[0].actions]
        return got

    def _lowered_schedule(self, cand: Candidate) -> Schedule:
        """The candidate's schedule checked and lowered once (what every simulation of it runs; only schedules
        that are simulated pay for it), cached per (kind, P, M)."""
        key = (cand.schedule, cand.pp, cand.per_replica)
        got = self._lowered.get(key)
        if got is None:
            got = self._lowered[key] = check_structure(self._schedule(cand)[0])
        return got

    def _stages(self, cand: Candidate) -> tuple[RunConfig, dict, dict[int, StageMemory]]:
        """The candidate's replica config (_replica), its layout and its stages' memory terms: what its memory and
        its recompute key need, no pricer built (most layouts of a search are over the budget and never priced).
        Cached per candidate; an optimizer-sharding twin takes its twin's layout and stages."""
        got = self._staged.get(cand)
        if got is None:
            twin = cand.distributed_optimizer and self._staged.get(replace(cand, distributed_optimizer=False))
            if twin:  # the optimizer's sharding weighs model states only: memory reads it from the config
                cfg, layout, mems = twin
                got = (cfg.model_copy(update={"train": cfg.train.model_copy(update={"distributed_optimizer": True})}),
                       layout, mems)
            else:
                schedule, _ = self._schedule(cand)
                cfg = self._replica(cand, schedule)
                layout = resolve_layout(cfg, schedule, cand.uneven)
                mems = shared_stage_memories(self._prices, cfg, self.spec, layout, self.base_opts.recompute)
                got = (cfg, layout, mems)
            self._staged[cand] = got
        return got

    def _replica(self, cand: Candidate, schedule: Schedule) -> RunConfig:
        """One replica's config of the candidate (replica_config), unvalidated (candidates() applied the rules), its
        balanced cut as parallel.stage_split."""
        cfg = self._with(cand, self._parallels(cand)[1])  # = replica_config(self._fast_config(cand))
        if cand.split == "balanced":  # the cut by cost, priced once per shape: it depends on T and EP, not recompute
            key = (cand.schedule, cand.pp, cand.microbatch_size, cand.ep)
            if key not in self._cuts:
                shape = Shape.of(cfg)  # what piece costs depend on (the model and the hardware are the search's)
                pieces = self._pieces.get(shape)
                if pieces is None:
                    pieces = self._pieces[shape] = piece_costs(cfg, self.hw)
                self._cuts[key] = [len(r) for r in balanced_split(cfg, self.hw, schedule, pieces)]
            cfg = self._with(cand, cfg.parallel.model_copy(update={"stage_split": self._cuts[key]}))
        return cfg

    def _prep(self, cand: Candidate) -> tuple[RunConfig, dict, SharedPricer]:
        """The candidate's replica config, layout and pricer (_stages'; an optimizer-sharding twin's pricer)."""
        got = self._prepared.get(cand)
        if got is None:
            cfg, layout, _ = self._stages(cand)
            twin = cand.distributed_optimizer and self._prepared.get(replace(cand, distributed_optimizer=False))
            pr = twin[2] if twin else SharedPricer(cfg, self.hw, self.spec, layout,
                                                   options_of(cand, self.hw, self.base_opts), shared=self._prices)
            got = self._prepared[cand] = (cfg, layout, pr)
        return got

    def memory(self, cand: Candidate) -> Evaluated:
        """Peak memory per rank, predict's model, without a simulation (live chunks in program order)."""
        twin = self._hp_twin(cand)
        peak = self._memory.get(twin)
        if peak is None:  # a layout and its hp twin need the same memory: computed once for both
            schedule, _ = self._schedule(twin)
            cfg, _, mems = self._stages(twin)
            per_node = fewest_ep_ranks_per_node(twin.pp, twin.dp, twin.ep, self.hw.gpus_per_node)  # options_of's
            peak = self._memory[twin] = self._peak_memory(twin, cfg, schedule, mems, per_node,
                                                          self._program_events(twin))
        return Evaluated(cand, peak)

    def _peak_memory(self, cand: Candidate, cfg: RunConfig, schedule: Schedule, mems: dict[int, StageMemory],
                     ep_per_node: int, events: list) -> float:
        """The largest rank's memory (memory.rank_memories, predict's model) of the candidate's program."""
        ranks = derived(schedule, "rank stages", lambda: {r: schedule.stages_of(r) for r in range(schedule.num_ranks)})
        peaks = self._peaks(events, mems)
        return max(m.total_bytes for m in rank_memories(cfg, self.spec, mems, ranks, dict(enumerate(events)),
                                                        hw=self.hw, dp=cand.dp, ep_per_node=ep_per_node,
                                                        peaks=dict(enumerate(peaks))))

    def _hp_twin(self, cand: Candidate) -> Candidate:
        """The candidate with hp = True, one object per candidate (dataclasses.replace costs more than a lookup)."""
        twin = self._hp.get(cand)
        if twin is None:
            twin = self._hp[cand] = cand if cand.hp else replace(cand, hp=True)
        return twin

    def _peaks(self, events: list, stage_mem: dict) -> list[tuple[float, dict[int, int]]]:
        """Each rank's activation peak (memory.activation_peak) for one program and its stages' chunk weights,
        computed once: layouts that differ in EP, the optimizer's sharding or the stream share it."""
        key = (id(events), tuple((s, m.chunk_activation_bytes) for s, m in sorted(stage_mem.items())))
        got = self._peak_cache.get(key)
        if got is None:
            got = self._peak_cache[key] = [activation_peak(ev, stage_mem) for ev in events]
        return got

    def recompute_key(self, cand: Candidate) -> tuple:
        """What a recompute choice does to the stages: their L_r (choices with the same L_r are one layout)."""
        mems = self._stages(self._hp_twin(cand))[2]
        return tuple(mems[s].recompute_block for s in sorted(mems))

    def bound(self, ev: Evaluated, exact: bool = True) -> float:
        """A lower bound on the step: per rank, the upstream forwards its first action waits for, its summed action
        durations (F&B pairs with their inputs on time; the rank runs them one after another) and the longer of
        the all-reduce its last action posts (data_parallel.sync_floor) and the upstream backwards waiting for
        that action's input gradient; the largest over the ranks. `exact=False`: the actions priced without
        recompute (it only adds kernels to the backward chains), which candidates differing only in their
        recompute choice share: a weaker bound, computed once for all of them."""
        priced = ev.cand if exact else replace(ev.cand, recompute="off")  # whose pricer: all the bound depends on
        return self._bound(ev, priced, False)

    def floor_bound(self, ev: Evaluated) -> float:
        """bound(ev, exact=False) with each action's floor (fb_overlap.floor: no stream run) for its price: weaker
        still, and cheap, so that a layout it prunes never prices its actions."""
        return self._bound(ev, replace(ev.cand, recompute="off"), True)

    def _bound(self, ev: Evaluated, priced: Candidate, floors: bool) -> float:
        got = self._bounds.get((priced, floors))
        if got is not None:
            ev.bound_us = got
            return got
        schedule, per_rank = self._schedule(ev.cand)
        cfg, layout, pr = self._prep(priced)
        ask = pr.floor_time if floors else pr.compute_time
        par = self._fast_config(ev.cand).parallel
        params = {s: m.params for s, m in pr.stage_mem.items()}
        # the all-reduces follow from these alone (the model, hardware and dtype are the search's): layouts that
        # differ in the stream, the optimizer's sharding or the recompute choice share them
        key = (id(schedule), par.data_parallel, par.expert_parallel, tuple(layout.items()), tuple(params.items()))
        floor = self._floors.get(key)
        if floor is None:
            full = cfg.model_copy(update={"parallel": par})
            floor = self._floors[key] = sync_floor(schedule, reductions(full, self.hw, schedule, layout, params))
        chains = derived(schedule, "first forward chains", lambda: first_forward_chains(schedule))
        hop = pr.transfer_time(None)
        prices: dict[tuple, float] = {}  # (kind, stage, backward stage) -> its price: each asked of pr once here

        def price(key: tuple) -> float:
            got = prices.get(key)
            if got is None:
                got = prices[key] = ask(_action(key))
            return got

        fill = []  # per rank: the upstream forwards (and sends) before its first action can start
        for r, chain in enumerate(chains):
            t, down = 0.0, r
            for st, src in chain:
                t += price((Kind.F, st, -1)) + (hop if src != down else 0.0)
                down = src
            fill.append(t)
        tail = []  # per rank: what follows its last action, the upstream backwards (and sends) or the all-reduce
        for r, chain in enumerate(derived(schedule, "last backward chains", lambda: last_backward_chains(schedule))):
            t, up = 0.0, r
            for kind, st, dst in chain:
                t += (hop if dst != up else 0.0) + price((kind, st, -1))
                up = dst
            tail.append(max(t, floor[r]))
        ev.bound_us = self._bounds[(priced, floors)] = max(
            fill[r] + sum(n * price(key) for key, n in counts.items()) + tail[r] for r, counts in enumerate(per_rank))
        return ev.bound_us

    def _simulate_key(self, cand: Candidate, lowered: Schedule, pr: SharedPricer) -> tuple:
        """What the engine's run of `lowered` reads (schedules.engine: one price per distinct (kind, stage[,
        backward stage]), one per message, the P2P rule; an F&B pair's timing with late inputs from its pricer):
        layouts with equal keys have the same simulation. Without F&B pairs that is the prices themselves, so a
        layout whose stream or optimizer sharding changes no price (1F1B's and ZB1P's hp twins often, every
        distributed-optimizer twin) reuses its twin's run; with pairs, only the same pricer (the optimizer twin's)."""
        _, per_rank = self._schedule(cand)
        kinds = sorted({key for counts in per_rank for key in counts})
        pairs = any(k is Kind.FB for k, _, _ in kinds)
        prices = tuple(pr.compute_time(_action(key)) for key in kinds)
        return (id(lowered), pr.opt.p2p, pr.transfer_time(None), prices, id(pr) if pairs else None)

    def evaluate(self, ev: Evaluated) -> Evaluated:
        """Simulate one replica's pipeline (predict's mHC run) and add the gradient all-reduce."""
        cand = ev.cand
        schedule, _ = self._schedule(cand)
        # the pricer its exact bound used (one replica's config, unvalidated: candidates() applied the rules;
        # tests/costmodel/test_tune.py predicts the written, validated config to the same step)
        cfg, layout, pr = self._prep(cand)
        full = cfg.model_copy(update={"parallel": self._fast_config(cand).parallel})
        lowered, events = self._lowered_schedule(cand), self._program_events(cand)
        # the analytic pricer simulates the checked, lowered schedule; a profile pricing (local) takes the original
        # (no spans: the step needs the makespan and each stage's last gradient write, which the engine keeps)
        if pr.profile_pricing is None:
            key = self._simulate_key(cand, lowered, pr)
            sim = self._sims.get(key)
            if sim is None:
                sim = self._sims[key] = pr.simulate(lowered, validate=False, record=False)
        else:
            sim = pr.simulate(schedule)
        ev.memory_bytes = self._peak_memory(cand, cfg, schedule, pr.stage_mem, pr.opt.ep_per_node, events)
        ev.pipeline_us = sim.makespan
        ev.sync = grad_sync(full, self.hw, schedule, sim, layout, {s: m.params for s, m in pr.stage_mem.items()})
        return ev


def _parallel_key(cand: Candidate) -> tuple:
    """What a candidate's parallel section holds (Candidate.overrides()'s parallel)."""
    return cand.schedule, cand.pp, cand.dp, cand.ep, cand.microbatches, cand.microbatch_size, cand.uneven


def _action(key: tuple) -> Action:
    """The action a schedule's (kind, stage, backward stage) count stands for, micro-batch 0 (prices do not
    depend on the micro-batch)."""
    k, st, b = key
    return Action(k, st, 0, b, 0 if b >= 0 else -1)


def tune(cfg: RunConfig, data: dict, hw: HardwareSpec, gpus: int, memory_gib: float, global_batch: int,
         **space) -> TuneResult:
    """Search the layouts of `cfg` (its raw mapping `data`, for the written configs) on `gpus` GPUs of `hw`
    under `memory_gib` per GPU for a step of `global_batch` sequences. `space`: candidates()'s choices.
    Nothing fitting the budget gives a result with an empty front and `smallest` set."""
    counts: Counter = Counter()
    tuner = Tuner(cfg, data, hw)
    cands = candidates(cfg, gpus, global_batch, counts=counts, built=tuner.built, **space)
    counts["layouts"] = len(cands)
    ref = reference_candidate(cfg, gpus, global_batch)
    seen: dict[tuple, Evaluated] = {}
    fits: list[Evaluated] = []
    smallest: Evaluated | None = None
    reference: Evaluated | None = None
    budget = memory_gib * GIB
    for c in cands:
        key = (c.schedule, c.pp, c.dp, c.ep, c.microbatch_size, c.hp, c.distributed_optimizer, c.split,
               tuner.recompute_key(c))
        if key in seen:  # e.g. a block size longer than every stage = auto on a one-block stage
            counts["same per-stage L_r as another recompute choice"] += 1
            reference = seen[key] if c == ref else reference
            continue
        ev = seen[key] = tuner.memory(c)
        reference = ev if c == ref else reference
        if smallest is None or ev.memory_bytes < smallest.memory_bytes:
            smallest = ev
        if ev.memory_bytes > budget:
            counts["over the memory budget"] += 1
            continue
        fits.append(ev)
    done: list[Evaluated] = []

    def dominated(ev: Evaluated) -> bool:
        # the runnable (hp) front must be complete on its own: only hp layouts bound hp layouts out
        return ev is not reference and any(d.memory_bytes <= ev.memory_bytes and d.step_us <= ev.bound_us
                                           for d in done if d.cand.hp or not ev.cand.hp)

    # visited in increasing cheap bound (then memory, then order), each cheap bound computed only for a layout its
    # floor bound does not prune: a heap holds each layout once, first under its floor bound, then under its cheap
    # one; a layout leaves under its cheap bound only when every other's entry, whose key is at most its cheap bound,
    # is at least as large, so the visits, the simulations and the counts are those of a sort by cheap bound
    heap = [(tuner.floor_bound(ev), ev.memory_bytes, i, False) for i, ev in enumerate(fits)]
    heapq.heapify(heap)
    while heap:
        key, _, i, cheap = heapq.heappop(heap)
        ev = fits[i]
        ev.bound_us = key
        if not cheap:
            if dominated(ev):  # by the floor bound, never priced
                counts["bounded out"] += 1
            else:
                heapq.heappush(heap, (tuner.bound(ev, exact=False), ev.memory_bytes, i, True))
            continue
        pruned = dominated(ev)  # by the cheap bound
        if not pruned:
            tuner.bound(ev)  # the exact one, only now
            pruned = dominated(ev)
        if pruned:
            counts["bounded out"] += 1
            continue
        tuner.evaluate(ev)
        counts["simulated"] += 1
        if ev.memory_bytes > budget:  # the simulation's peaks are the program-order ones: should not happen
            counts["over the memory budget after simulation"] += 1
            continue
        done.append(ev)
    runnable = [d for d in done if d.cand.hp]
    best = min(runnable, key=lambda d: (d.step_us, d.memory_bytes)) if runnable else None
    return TuneResult(pareto(done), best, reference, counts, smallest, tuner, ties_of(runnable, best))
