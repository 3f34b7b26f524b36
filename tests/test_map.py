"""The map is true: README's layout table names every module of every product package (and only modules that
exist there), and docs/design.md names every package and every pipeline sub-package. A module added without a
line on the map, or a line left after its module moved, fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schedules", "kernels", "pipeline", "mhcpipe", "costmodel", "traces", "configs", "bench")


def _rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):text.index("## Conventions")]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)/` \| (.*) \|$", section, re.M)}


def _modules(pkg: str) -> set[str]:
    return {p.name for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts}


@pytest.mark.parametrize("pkg", PACKAGES)
def test_readme_layout_names_every_module_and_only_real_ones(pkg):
    rows = _rows()
    assert pkg in rows, f"README's layout table has no row for {pkg}/"
    named = {n.split("/")[-1] for n in re.findall(r"`([A-Za-z_0-9/]+\.py)`", rows[pkg])}
    mods = _modules(pkg)
    assert not mods - named, f"README's {pkg}/ row does not name {sorted(mods - named)}"
    assert not named - mods, f"README's {pkg}/ row names {sorted(named - mods)}, which {pkg}/ does not hold"


def test_design_names_every_package_and_pipeline_sub_package():
    text = (ROOT / "docs" / "design.md").read_text()
    for pkg in ("schedules", "kernels", "pipeline", "mhcpipe", "costmodel", "traces", "configs"):
        assert f"`{pkg}/`" in text, f"docs/design.md does not name {pkg}/"
    subs = sorted(p.name for p in (ROOT / "pipeline").iterdir() if (p / "__init__.py").exists())
    missing = [s for s in subs if f"`{s}/`" not in text]
    assert not missing, f"docs/design.md does not name pipeline/{missing}"
    assert "pipeline.run " not in text and "`pipeline.run`" not in text  # no such module


def _package_inits():
    for init in sorted(ROOT.glob("*/**/__init__.py")):
        top = init.relative_to(ROOT).parts[0]
        if top in ("schedules", "kernels", "pipeline", "mhcpipe", "costmodel", "traces", "configs"):
            yield init


@pytest.mark.parametrize("init", list(_package_inits()), ids=lambda p: str(p.relative_to(ROOT).parent))
def test_every_package_index_names_its_modules(init):
    import ast

    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    here = init.parent
    names = [p.stem for p in here.glob("*.py") if p.name != "__init__.py"]
    names += [p.name for p in here.iterdir() if (p / "__init__.py").exists()]
    missing = sorted(n for n in names if n not in doc)
    assert not missing, f"{init.relative_to(ROOT)}'s docstring does not name {missing}"
