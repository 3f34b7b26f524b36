"""The import graph of our packages (design.md, "Dependency direction"), read from the source with `ast`: every
`import` and `from ... import` counts, at module level or inside a function (a deferred import is still a
dependency; it only hides a circle until something runs it).

* No circles: no module reaches itself through the imports of other modules.
* Layering: a package imports only the packages below it - traces and kernels nothing of ours, schedules
  traces, the config models kernels and schedules (validation builds the schedule), costmodel schedules,
  traces and configs, pipeline kernels, schedules, traces and configs, the app layer (mhcpipe) everything;
  nothing imports mhcpipe.
* Inside pipeline the sub-packages are layered the same way (PIPELINE_ALLOWED; each one's __init__ docstring
  says it): distributed at the bottom, then observability, checkpoint, runtime, launch, the torchrun entry.
* Inside costmodel the analytic core never imports the `local` host emulation: local plugs in through the
  interfaces the core defines (pricing.ProfilePricing, trace_fit.TraceFitter). Only the predict command's
  wiring (mhcpipe.predict_cli, in the app layer) names both.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "kernels", "traces", "schedules", "costmodel", "pipeline", "mhcpipe")
ALLOWED = {  # package -> the packages of ours it may import
    "kernels": set(),
    "traces": set(),
    "schedules": {"traces"},
    "configs": {"kernels", "schedules", "traces"},
    "costmodel": {"schedules", "traces", "configs"},
    "pipeline": {"kernels", "schedules", "traces", "configs"},
    "mhcpipe": {"configs", "kernels", "traces", "schedules", "costmodel", "pipeline"},
}
# inside pipeline: sub-package (or "top" for the modules at pipeline/) -> the others it may import
PIPELINE_TOP = "top"
PIPELINE_ALLOWED = {
    "device": set(),
    "top": set(),
    "distributed": {"device"},
    "observability": {"distributed", "device"},
    "checkpoint": {"distributed", "top"},
    "runtime": {"distributed", "observability", "checkpoint", "top", "device"},
    "launch": {"distributed", "observability", "checkpoint", "runtime", "top", "device"},
    "__main__": {"distributed", "observability", "checkpoint", "runtime", "launch", "top"},
}
LOCAL = "costmodel.local"
LOCAL_WIRING = {"mhcpipe.predict_cli"}  # may import both rooms of costmodel


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of our packages (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports anywhere in its source (`from p import m` is module p.m when that
    exists, else p)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` of a name inside a module: the module a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def pipeline_room(module: str) -> str:
    """The sub-package of pipeline a module lives in ("top" for pipeline/<module>.py and the package itself)."""
    parts = module.split(".")
    if parts[1:] == ["__main__"]:
        return "__main__"
    if len(parts) >= 3:
        return parts[1]
    return PIPELINE_TOP


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        pkg = src.split(".")[0]
        for dst in sorted(targets):
            other = dst.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                may = ", ".join(sorted(ALLOWED[pkg])) or "nothing of ours"
                bad.append(f"{src} -> {dst} ({pkg} may import {may})")
            if pkg == other == "pipeline":
                room, to = pipeline_room(src), pipeline_room(dst)
                if room != to and to not in PIPELINE_ALLOWED[room]:
                    may = ", ".join(sorted(PIPELINE_ALLOWED[room])) or "nothing else of pipeline"
                    bad.append(f"{src} -> {dst} (pipeline.{room} may import {may})")
            in_local = src == LOCAL or src.startswith(LOCAL + ".")
            if (pkg == "costmodel" and not in_local and src not in LOCAL_WIRING
                    and (dst == LOCAL or dst.startswith(LOCAL + "."))):
                bad.append(f"{src} -> {dst} (the costmodel core never imports costmodel.local)")
    return bad


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_package_is_walked(graph):
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    assert "schedules.simulate" in graph["costmodel.pricing.pricer"]  # a module-level import
    assert "schedules.build" in graph["schedules.torch_csv"]  # an import inside a function


def test_no_module_imports_itself_through_others(graph):
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_packages_import_only_downward(graph):
    bad = forbidden_imports(graph)
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    """The walk resolves relative and function-level imports and the checks flag what they must."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "schedules" / "a.py").write_text("from . import b\n")
    (tmp_path / "schedules" / "b.py").write_text("def f():\n    from schedules.a import x\n")
    (tmp_path / "traces" / "t.py").write_text("def g():\n    import costmodel.pricing\n")
    (tmp_path / "costmodel" / "pricing.py").write_text("from costmodel.local import host\n")
    (tmp_path / "costmodel" / "local").mkdir()
    (tmp_path / "costmodel" / "local" / "__init__.py").write_text("")
    (tmp_path / "costmodel" / "local" / "host.py").write_text("from ..pricing import x\n")
    (tmp_path / "pipeline" / "distributed").mkdir()
    (tmp_path / "pipeline" / "distributed" / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "distributed" / "comm.py").write_text("def h():\n    from ..runtime import train\n")
    (tmp_path / "pipeline" / "runtime").mkdir()
    (tmp_path / "pipeline" / "runtime" / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "runtime" / "train.py").write_text("from pipeline.distributed import comm\n")
    g = import_graph(tmp_path)
    assert sorted(circles(g)) == [["costmodel.local.host", "costmodel.pricing"],
                                  ["pipeline.distributed.comm", "pipeline.runtime.train"],
                                  ["schedules.a", "schedules.b"]]
    bad = forbidden_imports(g)
    assert any(b.startswith("traces.t -> costmodel.pricing") for b in bad)
    assert any(b.startswith("costmodel.pricing -> costmodel.local.host (the costmodel core") for b in bad)
    assert "pipeline.distributed.comm -> pipeline.runtime.train (pipeline.distributed may import device)" in bad
    assert not any(b.startswith("pipeline.runtime.train ->") for b in bad)


# The one module outside the app layer that parses a command line: the torchrun entry's body (it declares the run's
# flags, which `mhcpipe run` reuses; `python -m pipeline` and a user's own torchrun script both call it). Nothing may
# be added here.
ARGV_OUTSIDE_APP = {"pipeline.launch.entry"}


def argv_parsers(root: Path = ROOT) -> set[str]:
    """Modules of ours, outside the app layer (mhcpipe), that import argparse."""
    out = set()
    for name, path in module_files(root).items():
        if name.split(".")[0] == "mhcpipe":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            if "argparse" in names:
                out.add(name)
    return out


def test_the_command_line_is_parsed_in_the_app_layer():
    extra = argv_parsers() - ARGV_OUTSIDE_APP
    assert not extra, f"argparse outside mhcpipe/: {sorted(extra)} (put the command in the app layer)"


COSTMODEL_ROOMS = ("physics", "pricing", "simulation", "answers", "fitting", "local")  # costmodel/__init__.py


def test_costmodel_rooms_import_only_the_rooms_before_them(graph):
    """costmodel by role: physics, pricing, simulation, answers, fitting, then the CPU-host emulation (local); a
    room imports only rooms listed before it (local plugs in through the interfaces the core defines)."""
    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == "costmodel" and len(parts) > 2 and parts[1] in COSTMODEL_ROOMS else None

    bad = sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                 if room(src) and room(dst) and COSTMODEL_ROOMS.index(room(dst)) > COSTMODEL_ROOMS.index(room(src)))
    assert not bad, bad
    flat = [m for m in graph
            if m.startswith("costmodel.") and m.count(".") == 1 and m.split(".")[1] not in COSTMODEL_ROOMS]
    assert not flat, f"modules outside costmodel's rooms: {flat}"
