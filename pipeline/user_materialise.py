"""A user model built on the meta device, materialised piece by piece: each rank allocates and initialises only the
pieces its stages hold, so a model larger than one host's memory runs split (torchtitan's recipe: build on meta,
`to_empty`, then initialise).

A builder builds on the meta device by wrapping its construction in `with torch.device("meta"):` (parameters get
shapes, no memory). `materialise(model, pieces, device, seed)` then gives each piece named in `pieces` ('embed',
'expand', 'blocks.<b>', 'head') real storage on `device` and initialises it under its own seed, derived from the
run's seed and the piece's name: the piece's `init_weights()` if it has one, else `reset_parameters()` of every
module in it that defines one (nn.Linear, nn.Embedding, nn.RMSNorm, pipeline.weight_grad.DeferLinear, mhc-pipe's
MHCSublayer and StreamExpand do). A piece's values therefore depend on nothing but (seed, piece): the unsplit
model materialised whole (check-split's reference, `materialise_all`) and every stage of every layout hold the same
values, bitwise.

A tied parameter (pipeline.user_model.Tie) is initialised by the piece that names it (its first holder); later
holders' initialisers leave it alone, and a rank holding only a later holder initialises a scratch copy of the
naming piece to get the value. Anything the initialisers leave untouched (a parameter or floating buffer whose
module has no initialiser: it would hold whatever the allocation held) is refused in one line naming it and the fix.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline.model import seeded
from pipeline.user_model import ContractError, UserModel, piece_of


def on_meta(model: UserModel) -> bool:
    """Was the model built on the meta device (any piece's parameter or buffer on it)?"""
    return any(t.is_meta for _, m in model.pieces() for t in (*m.parameters(), *m.buffers()))


def materialise_all(model: UserModel, device: torch.device, seed: int) -> None:
    """Every piece (the unsplit model)."""
    materialise(model, {piece for piece, _ in model.pieces()}, device, seed)


def materialise(model: UserModel, pieces: set[str], device: torch.device, seed: int) -> None:
    """Allocate and initialise `pieces` of a meta-built model on `device` (module docstring); others stay on meta."""
    modules = dict(model.pieces())
    ties = model.ties()
    order = [piece for piece, _ in model.pieces() if piece in pieces]
    for piece in order:
        module = modules[piece]
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            module.to_empty(device=device)
            with torch.no_grad():
                for t in (*module.parameters(), *module.buffers()):
                    if t.is_floating_point():
                        t.fill_(float("nan"))  # what no initialiser touches is found below
    _retie(model, ties, pieces)
    owned_elsewhere = {}  # tied parameter name -> the parameter, for ties named by a piece initialised earlier
    for piece in order:
        keep = {name: p.detach().clone() for name, p in owned_elsewhere.items()}
        with seeded(seed, f"user-model/{piece}"):
            _initialise(modules[piece])
        with torch.no_grad():
            for name, value in keep.items():
                owned_elsewhere[name].copy_(value)
        for tie in ties:
            if tie.pieces[0] == piece:
                owned_elsewhere[tie.name] = _param(modules, tie.name)
    for tie in ties:  # named by a piece this rank does not hold: its value from a scratch copy of that piece
        owner = tie.pieces[0]
        if owner in pieces or not set(tie.pieces) & pieces:
            continue
        scratch = copy.deepcopy(modules[owner]).to_empty(device=device)
        with seeded(seed, f"user-model/{owner}"):
            _initialise(scratch)
        value = dict(scratch.named_parameters(prefix=owner))[tie.name]
        with torch.no_grad():
            _param(modules, next(a for a in tie.aliases if piece_of(a) in pieces)).copy_(value)
        del scratch
    for piece in order:
        for kind, named in (("parameter", modules[piece].named_parameters(prefix=piece)),
                            ("buffer", modules[piece].named_buffers(prefix=piece))):
            for name, t in named:
                if t.is_floating_point() and bool(torch.isnan(t).any()):
                    raise ContractError(f"{kind} {name}: built on the meta device, and no initialiser of its piece "
                                        "set it; give its module reset_parameters() (or the piece init_weights()), "
                                        "or build the model on the CPU")


def _initialise(module: nn.Module) -> None:
    init = getattr(module, "init_weights", None)
    if callable(init):
        init()
        return
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def _param(modules: dict[str, nn.Module], name: str) -> nn.Parameter:
    """The parameter of global name `name` ('blocks.3.attn.w', 'head.lm.out.weight')."""
    piece = piece_of(name)
    return modules[piece].get_parameter(name[len(piece) + 1:])


def _retie(model: UserModel, ties, pieces: set[str]) -> None:
    """`to_empty` gives every module its own new parameter: make every holder of a tie share one again, the local
    holders' (pieces not held here then hold that one real parameter, so the tie stays visible to `ties()`)."""
    modules = dict(model.pieces())
    for tie in ties:
        names = (tie.name, *tie.aliases)
        local = [n for n in names if piece_of(n) in pieces]
        if not local:
            continue
        shared = _param(modules, local[0])
        for name in names:
            if name == local[0]:
                continue
            piece = piece_of(name)
            path = name[len(piece) + 1:].rpartition(".")
            modules[piece].get_submodule(path[0]).register_parameter(path[2], shared)
