"""The package's imports run one way: no import circle, counting lazy imports inside functions.

Read from the source (``ast``), so an import placed inside a function to dodge a circle at
import time counts as an edge too. Edges go from a module to each of our modules it
imports by name (``from .x import y`` is an edge to ``x``, or to ``x.y`` when that is a
module); a package's ``__init__`` counts as the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from lanes import (
    CI_LANE_2_FILES,
    LANES,
    SECOND_HALF_FILES,
    in_half,
    in_lane,
    in_megatron_lanes,
    in_stack_lane,
)

ROOT = Path(__file__).resolve().parent.parent / "startrail_megatron"
PKG = "startrail_megatron"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" for a in node.names] + [src]
                # ``from .x import y``: y's module if it is one, else x itself
                targets = [t for t in targets[:-1] if t in mods] or [targets[-1]]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != mod and t.startswith(PKG):
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    g = _graph()
    assert "startrail_megatron.kernels.choice" in g["startrail_megatron.kernels"]
    assert "startrail_megatron.schedule" in g["startrail_megatron.rank.forward"]
    # a lazy import inside a function counts
    assert "startrail_megatron.megatron.attention" in g["startrail_megatron.deepspeed.megatron_gpt"]


def test_no_import_circle():
    assert _cycles(_graph()) == []


ENTRY_POINTS = (f"{PKG}.launch", f"{PKG}.pretrain_gpt", f"{PKG}.dit.train")
"""Commands above the packages: two shims, and the DiT trainer's command line, which picks
the plain loop (``dit.loop``) or the DeepSpeed path (``deepspeed.dit``) for
``--deepspeed-config``. Nothing in the package imports one."""

COMMAND_LINE_NAMES = {"main", "args_from_cli", "build_parser"}
"""The public names an entry point may define: its command line, nothing a library needs."""


def _public_definitions(path: Path) -> set[str]:
    """The module's public top-level functions and classes, and what its ``__all__`` lists."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.name.startswith("_"):
                names.add(node.name)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names.update(ast.literal_eval(node.value))
    return names


def _package(mod: str) -> str:
    """The package a module counts in: its subpackage of ours, or itself if top-level."""
    return ".".join(mod.split(".")[:2])


def test_the_core_never_imports_an_adapter():
    g = _graph()
    core = [m for m in g if not m.startswith((f"{PKG}.megatron", f"{PKG}.deepspeed"))]
    # shims, and the DiT trainer's command line: entry points above the adapters
    core = [m for m in core if m not in ENTRY_POINTS]
    for m in core:
        bad = {t for t in g[m] if t.startswith((f"{PKG}.megatron", f"{PKG}.deepspeed"))}
        assert not bad, (m, bad)


def test_no_private_name_crosses_a_module():
    """``from .x import _y`` between our modules: a private name is that module's own
    (make it public, or move it, where another module needs it)."""
    bad = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            ours = node.level > 0 or (node.module or "").startswith(PKG)
            names = [a.name for a in node.names if a.name.startswith("_")]
            if ours and names and node.module != "__future__":
                bad.append((mod, node.module, names))
    assert bad == []


def test_entry_points_hold_only_their_command_line():
    """An entry point defines its command line only and nothing imports it, so the code it
    runs sits in the packages, where the package-level check below sees its imports."""
    g, mods = _graph(), _modules()
    for entry in ENTRY_POINTS:
        importers = sorted(m for m in g if entry in g[m])
        assert not importers, (entry, importers)
        extra = _public_definitions(mods[entry]) - COMMAND_LINE_NAMES
        assert not extra, (entry, sorted(extra))


def test_no_package_level_import_circle():
    """Packages import each other one way (e.g. deepspeed/ imports dit/, never back),
    counting every module in its package (``_package``), lazy imports too. Only an entry
    point that holds nothing but its command line sits above the packages on its own."""
    g, mods = _graph(), _modules()
    above = {e for e in ENTRY_POINTS if not _public_definitions(mods[e]) - COMMAND_LINE_NAMES}

    def node(m: str) -> str:
        return m if m in above else _package(m)

    packages: dict[str, set[str]] = {node(m): set() for m in g}
    for m, targets in g.items():
        packages[node(m)].update(node(t) for t in targets if node(t) != node(m))
    assert _cycles(packages) == []


def test_no_command_line_imports_another():
    """A flag several commands share is defined once outside them (``cli_options``)."""
    g = _graph()
    commands = {m for m in g if m.endswith(".cli")} | {f"{PKG}.dit.train"}
    for m in sorted(commands):
        assert not g[m] & commands, (m, sorted(g[m] & commands))


LAYERS = [
    ["schedule", "accounting"],
    ["kernels"],
    ["zigzag"],
    ["comm"],
    ["groups"],
    ["validation"],
    ["rank"],
    ["attention", "joint", "one_process", "batch_attention"],
    ["peers"],
    ["testing"],
    [
        "bench",
        "planner",
        "gpu_check",
        "demo",
        "spawn",
        "cli_options",
        "emulate",
        "checkpoint_files",
        "auto_placement",
    ],
    ["dit"],
    ["megatron"],
    ["deepspeed"],
    ["pretrain_gpt", "launch"],
]
"""The layers of ``docs/architecture.md``, bottom up: each imports only its own layer and
those listed before it."""


def test_layers_import_downward():
    """Every import goes to the importer's layer or one listed before it; the one exception
    is the DiT trainer's command line, which reaches the DeepSpeed adapter (above it) for
    ``--deepspeed-config`` (``test_entry_points_hold_only_their_command_line``)."""

    def layer(m: str) -> int:
        top = m[len(PKG) + 1 :].split(".")[0]
        found = [i for i, names in enumerate(LAYERS) if top in names]
        assert found, f"{m}: in no layer of docs/architecture.md"
        return found[0]

    bad = []
    for m, targets in _graph().items():
        if m == PKG:
            continue
        for t in targets - {PKG}:
            if layer(t) > layer(m) and m not in ENTRY_POINTS:
                bad.append((m, t))
    assert bad == []


_STACK = re.compile(
    r"^(megatron|deepspeed|transformers)(\.|$)"
    r"|^startrail_megatron\.(megatron|deepspeed|dit|pretrain_gpt)(\.|$)"
    r"|^(megatron_common|ds_common)$"
)


def _imported_names(src: str) -> list[str]:
    """Every absolute import's module, and ``module.name`` for each name a ``from`` takes."""
    names = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def _imports_the_stack(path: Path) -> bool:
    """The file imports megatron-core, DeepSpeed, transformers, our adapters or their test
    helpers, or runs one of our adapters' entry points by module name."""
    src = path.read_text()
    if re.search(r"startrail_megatron\.(megatron|deepspeed|dit|pretrain_gpt)\b", src):
        return True
    return any(_STACK.search(n) for n in _imported_names(src))


_MEGATRON = re.compile(
    r"(^|[^\w.])megatron\.(core|training)\b"
    r"|startrail_megatron\.(megatron|pretrain_gpt)\b"
    r"|\b(megatron_common|megatron_gpt|megatron_mpu|_maybe_install_megatron_hooks)\b"
)


def _reaches_megatron(path: Path, seen: frozenset = frozenset()) -> bool:
    """The file's code reaches megatron-core: it names megatron-core, our Megatron adapter,
    the DeepSpeed adapter's megatron-core parts or the Megatron test helpers, or imports a
    test module that does (the harness's ``PRELOAD`` names megatron-core too: importing a
    module runs none of it)."""
    src = path.read_text()
    if _MEGATRON.search(src):
        return True
    for n in _imported_names(src):
        local = path.parent / f"{n}.py"
        test_module = n.startswith("test_") and local.exists() and n not in seen
        if n == "megatron" or (test_module and _reaches_megatron(local, seen | {path.stem})):
            return True
    return False


def test_every_test_of_the_stack_runs_on_both_releases():
    """The ``stack`` lane runs ``lanes.STACK_TEST_FILES``: every test file that imports
    megatron-core, DeepSpeed, transformers or our adapters must be among them. CI runs every
    test file reaching megatron-core on both lanes (both releases: ``MEGATRON_TEST_FILES``),
    every other file once."""
    tests = Path(__file__).resolve().parent
    files = sorted(p.name for p in tests.glob("test_*.py"))
    stack = {n for n in files if _imports_the_stack(tests / n)}
    megatron = {n for n in files if _reaches_megatron(tests / n)}
    assert {"test_megatron.py", "test_deepspeed_models.py", "test_dit.py"} <= stack  # works
    assert {"test_megatron_window.py", "test_deepspeed_megatron.py"} <= megatron  # also through
    assert not megatron & {"test_deepspeed.py", "test_dit.py", "test_attention.py"}
    missing = sorted(n for n in stack if not in_stack_lane(n))
    assert not missing, f"add these to tests/lanes.py STACK_TEST_FILES: {missing}"
    missing = sorted(n for n in megatron if not in_megatron_lanes(n))
    assert not missing, f"add these to tests/lanes.py MEGATRON_TEST_FILES: {missing}"
    assert not in_stack_lane("test_attention.py")
    assert set(CI_LANE_2_FILES) <= set(files)
    for n in files:
        lanes = [lane for lane in ("ci-1", "ci-2") if in_lane(n, lane)]
        want = ["ci-2"] if n in CI_LANE_2_FILES else ["ci-1"]
        assert lanes == (["ci-1", "ci-2"] if in_megatron_lanes(n) else want), (n, lanes)
        assert in_lane(n, "all")
    assert not any(n in megatron or in_megatron_lanes(n) for n in CI_LANE_2_FILES)
    with pytest.raises(ValueError, match="--lane 'ci3': expected one of"):
        in_lane("test_attention.py", "ci3")
    assert LANES == ("all", "stack", "ci-1", "ci-2")


def test_the_two_halves_run_every_test_file_once():
    """``--half 1`` and ``--half 2`` (run side by side by ``scripts/run_tests.sh``) split the
    test files: each in exactly one half, every name in ``SECOND_HALF_FILES`` a test file,
    and the one that builds emulated network namespaces in the second half."""
    files = sorted(p.name for p in Path(__file__).resolve().parent.glob("test_*.py"))
    assert set(SECOND_HALF_FILES) <= set(files)
    for n in files:
        assert [h for h in (1, 2) if in_half(n, h)] == [2 if n in SECOND_HALF_FILES else 1], n
        assert in_half(n, 0)
    assert in_half("test_emulate.py", 2) and in_half("test_attention.py", 1)
    with pytest.raises(ValueError, match="--half 3: expected one of 0, 1, 2"):
        in_half("test_attention.py", 3)


def test_the_pure_packages_start_without_torch():
    """``startrail-plan`` and the emulation's parent (``planner``, ``emulate``) import no
    torch: the package's names resolve on first use (``startrail_megatron/__init__.py``)."""
    import subprocess
    import sys

    code = (
        "import sys, startrail_megatron, startrail_megatron.planner.cli, "
        "startrail_megatron.emulate, startrail_megatron.schedule; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules)); "
        "from startrail_megatron import StarTrailGroups, joint; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True"], out.stdout
