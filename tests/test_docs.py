"""The docs name only what exists: the code spans, commands, flags and links of README.md and
docs/*.md are checked against the code, so a rename that leaves a page behind fails here.

One test per page, listing every stale span at once as ``FILE:LINE: `span`: why``. Pure and
fast: the pages are read line by line and the project's Python with ``ast``; nothing of
ours is imported, nor torch, megatron-core or DeepSpeed (``test_this_file_imports_no_code``).

What a page is checked for (``check_markdown``):

* an inline code span, by what it looks like:
  - a path (it has a ``/`` or a file extension): it exists from the repository root, the
    page's folder or ``startrail_megatron/``; a bare file or folder name (``layout.py``,
    ``te/``) exists somewhere in the repository; a glob (``test_megatron*.py``) matches;
    ``FILE.py::test_x`` names a test of that file;
  - ``st.X...`` / ``startrail_megatron.X...`` (``import startrail_megatron as st``): each
    part resolves through the package's modules, the names each module defines or imports,
    the packages' lazy name tables (the root's: ``st.X`` exists iff X is in that table and
    its module defines X, or X is a submodule) and the members of our classes;
  - another dotted name (``schedule.plan_step``, ``KVRing.held``): the same, from every
    module whose dotted path ends so, or from a class; ``obj.member`` (``tokens.gather``):
    a member of a class (of module ``obj`` if there is one);
  - a bare name called (``uninstall()``) is a function or class of ours (or of the tests);
    a bare name that looks like code (``zigzag_shard``, ``StarTrailLayout``, ``PACKED_X``)
    is defined by us (a function, class, assignment target, attribute, parameter, keyword or
    module name; not an ``__all__`` or lazy-table entry, which only names), is a string our
    code handles (a config key, a kernel name), or is an external name (``EXTERNAL_NAMES``);
  - the keywords of a call (``startrail_attention(window=, softcap=)``) are parameters of a
    function (or fields of a class) of that name, unless it takes ``**kwargs``;
  - ``name=value``: ``name`` as above, or an environment variable of our code;
  - names under torch, transformers, flash-attn, Transformer Engine, the standard library,
    Megatron-LM's packages (``EXTERNAL_MEGATRON``) and ``EXTERNAL_DEEPSPEED`` are accepted;
    any other ``megatron.X`` / ``deepspeed.X`` is one of our adapters;
* in spans and in code blocks (fenced or indented: the commands users copy):
  - every flag (``--foo``, ``--foo=v``, ``--foo-*``) is defined by our code (a string
    literal of ``startrail_megatron/`` or ``scripts/`` or ``tests/conftest.py``, a flag a
    loop builds from a table of its module, a flag of the scripts' shell code, or one of
    Megatron-LM's flags that our entry point takes, ``megatron_lm_flags.txt``) or is
    another tool's (``EXTERNAL_FLAGS``);
  - ``startrail-*`` commands are setup.py's console scripts, whose targets exist;
  - ``-m startrail_megatron...`` names a runnable module (a ``__main__`` guard, or a
    package with ``__main__.py``);
  - ``STARTRAIL_*`` environment variables appear in the code;
  - a path a command takes under one of the repository's folders (``scripts/``, ...) exists;
  - ``st.X`` / ``startrail_megatron.X`` names, and what a Python block imports from the
    package, resolve;
* every link or image (``[t](target)``, ``![a](target)``, ``<img src=...>``) with a relative
  target is a file, and its ``#anchor`` a heading of the target page.

Not checked: values and expressions (``"auto"``, ``[s, b, h, d]``, ``Y + 4``), single
lowercase words (``ring``, ``torch``: values and prose as often as names), JSON keys,
suffixes (``.png``), external links, and names under the external packages above.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import os
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = "startrail_megatron"
_THIS = f"tests/{Path(__file__).name}"  # not read: its test pages name what does not exist

# --- the allowlists: what the docs may name that our code does not define -------------

# fmt: off
EXTERNAL_NAMES = {
    # megatron-core and Megatron-LM
    "GPTModel", "HybridModel", "MambaModel", "GPTDataset", "MockGPTDataset",
    "OptimizerParamScheduler", "DistributedDataParallel", "PackedSeqParams",
    "WrappedTorchNorm", "get_batch_on_this_cp_rank", "parallel_state", "pretrain",
    "parse_and_validate_args", "BalancedCPScheduler", "HybridCPDataLoaderWrapper",
    "get_thd_batch_on_this_cp_rank", "get_batch_on_this_tp_rank", "backward_step",
    "pg_collection", "pg_collection.cp",
    # torch
    "MemTracker", "init_process_group", "destroy_process_group",
    # DeepSpeed
    "DistributedAttention", "inference_all_reduce", "overlap_comm", "TiledMLP",
    "TiledFusedLogitsLoss", "sequence_tiled_compute",
    # Transformer Engine
    "AttnFuncWithCPAndKVP2P", "softmaxStats",
}
"""Names of megatron-core, torch, DeepSpeed and Transformer Engine that the docs quote
without their module (those our code handles, as a string or a keyword, need no entry)."""

EXTERNAL_ROOTS = ("torch", "transformers", "flash_attn", "transformer_engine")
"""Dotted names under these (and under the standard library's modules) are accepted."""

EXTERNAL_MEGATRON = ("core", "training", "legacy")
"""Megatron-LM's packages: ``megatron.X`` for X among these is Megatron-LM's; any other X
is our Megatron adapter's (``megatron/``)."""

EXTERNAL_DEEPSPEED = ("deepspeed.initialize", "deepspeed.init_distributed")
"""DeepSpeed's names the docs quote; any other ``deepspeed.X`` is our adapter's."""

EXTERNAL_FLAGS = {"--num_gpus", "--module", "--dynamic-context-parallel"}
"""Flags of other tools the docs use that our code does not pass itself: DeepSpeed's
launcher's, and Megatron-LM's dev branch's dynamic CP (which ``megatron/refusals.py``
refuses)."""

EXTERNAL_ENV: set[str] = set()
"""Environment variables of other tools that the docs set and our code does not name."""

EXTERNAL_PATHS = {
    "attention/dot_product_attention/context_parallel.py",  # Transformer Engine's
    "megatron/core",  # Megatron-LM's tree
    "FlashAttentionKernel.cpp",  # PyTorch's
}
"""Paths in other projects' trees that the docs quote."""

GENERATED_PATHS = {".venv/", ".venv-py312/", "bench_attention.json"}
"""Folders and files the scripts create (none in a fresh clone)."""

OUTSIDE = ("../", "shared/")
"""Paths that leave the repository (or name the workspace around it, which a clone has not):
a page may not point there; what a reader needs lives in the repository."""

PLACEHOLDERS = {"DIR", "FILE", "SCRIPT", "REPORT", "PATH"}
"""Words that stand for the user's own path in a command."""
# fmt: on

_EXTENSIONS = "py|sh|md|json|jsonl|png|txt|patch|toml|cfg|yaml|cpp|cu|h"
_EXCLUDED_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
_EXCLUDED_TOP = {"build", "dist", "data", "bench_out", ".cache"}  # .gitignore's: run outputs
_BUILTINS = set(dir(builtins))
_FLAG_LITERAL = re.compile(r"--[A-Za-z][\w-]*")
_IDENT_LITERAL = re.compile(r"[A-Za-z_][\w.-]*")
_UPPER = re.compile(r"\b[A-Z][A-Z0-9_]+\b")


def _pages(root: Path = ROOT) -> list[str]:
    return ["README.md", *(f"docs/{p.name}" for p in sorted((root / "docs").glob("*.md")))]


# --- the code's index -------------------------------------------------------------------


@dataclass
class _Def:
    """A function's parameters, or a class's (its ``__init__``'s and its fields)."""

    params: set[str] = field(default_factory=set)
    any_kwargs: bool = False


@dataclass
class _Class:
    module: str
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class _Module:
    name: str
    is_package: bool
    names: set[str] = field(default_factory=set)  # top level: defined or imported
    imports: dict[str, str] = field(default_factory=dict)  # alias -> absolute dotted name
    classes: set[str] = field(default_factory=set)
    lazy: dict[str, str] = field(default_factory=dict)  # name -> the module defining it
    runnable: bool = False


class Code:
    """What the repository at ``root`` holds and defines, read from its files; ``overrides``
    (path relative to ``root`` -> text) replace files, to check the docs against an edit."""

    def __init__(self, root: Path = ROOT, overrides: dict[str, str] | None = None):
        self.root = root
        self.overrides = overrides or {}
        self.files: set[str] = set()  # relative paths; folders end with "/"
        self.basenames: set[str] = set()
        self.modules: dict[str, _Module] = {}
        self.suffixes: dict[str, list[str]] = {}  # "schedule.layout" -> the modules ending so
        self.classes: dict[str, list[_Class]] = {}
        self.defs: dict[str, list[_Def]] = {}  # functions and classes, by name
        self.known: set[str] = set()  # every name we define, and the modules' names
        self.strings: set[str] = set()  # identifier-like string literals of ours
        self.env: set[str] = set()  # upper-case words of our strings and shell scripts
        self.flags: set[str] = set()
        self.commands: dict[str, str] = {}  # console script -> "module.function"
        self._walk()
        for rel in sorted(self.files):
            if rel.endswith(".py") and rel.startswith((f"{PKG}/", "scripts/")):
                self._read_python(rel)
            elif rel.endswith(".py") and rel.startswith("tests/") and rel != _THIS:
                self._read_test(rel)
            elif rel.endswith(".sh") and rel.startswith("scripts/"):
                self._read_shell(rel)
        flags = f"{PKG}/megatron/training/megatron_lm_flags.txt"
        if flags in self.files:  # Megatron-LM's own flags, which our entry point takes
            lines = self.text(flags).splitlines()
            self.flags.update(line.split()[0] for line in lines if line.startswith("--"))
        self._read_setup()
        for mod in self.modules:
            parts = mod.split(".")
            for i in range(len(parts)):
                self.suffixes.setdefault(".".join(parts[i:]), []).append(mod)
            self.known.add(parts[-1])

    def text(self, rel: str) -> str:
        if rel in self.overrides:
            return self.overrides[rel]
        return (self.root / rel).read_text(encoding="utf-8", errors="replace")

    def _walk(self) -> None:
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            rel = "" if rel == "." else f"{rel}/"
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in _EXCLUDED_DIRS
                and not (rel == "" and d in _EXCLUDED_TOP)
                and not d.startswith(".venv")
                and not d.endswith(".egg-info")
            )
            for name in [f"{d}/" for d in dirnames] + filenames:
                self.files.add(rel + name)
                self.basenames.add(name)

    def _read_python(self, rel: str) -> None:
        try:
            tree = ast.parse(self.text(rel))
        except SyntaxError:
            return
        where = rel  # a class's place: its module, or a script
        if rel.startswith(f"{PKG}/"):
            parts = rel[: -len(".py")].split("/")
            is_package = parts[-1] == "__init__"
            mod = _Module(".".join(parts[:-1] if is_package else parts), is_package)
            _read_module(mod, tree, rel.endswith("__main__.py"))
            self.modules[mod.name] = mod
            where = mod.name
        excluded = _table_strings(tree)
        for stmt in tree.body:
            top = _class(stmt, where) if isinstance(stmt, ast.ClassDef) else None
            for node in ast.walk(stmt):
                kind = type(node)
                if kind in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
                    self.known.add(node.name)
                    self.defs.setdefault(node.name, []).append(_signature(node))
                    if kind is ast.ClassDef:
                        cls = top if node is stmt else _class(node, where)
                        self.classes.setdefault(node.name, []).append(cls)
                    else:
                        a = node.args
                        self.known.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
                elif kind is ast.Name:
                    if type(node.ctx) is ast.Store:
                        self.known.add(node.id)
                elif kind is ast.Attribute:
                    if type(node.ctx) is ast.Store:
                        self.known.add(node.attr)
                        v = node.value
                        if top is not None and type(v) is ast.Name and v.id in ("self", "cls"):
                            top.members.add(node.attr)
                elif kind is ast.keyword:
                    if node.arg:
                        self.known.add(node.arg)
                elif kind is ast.Constant:
                    s = node.value
                    if type(s) is str:
                        if s[:2] == "--" and _FLAG_LITERAL.fullmatch(s):
                            self.flags.add(s)
                        elif id(node) not in excluded and _IDENT_LITERAL.fullmatch(s):
                            self.strings.add(s)
                        self.env.update(_UPPER.findall(s))
                elif kind is ast.For:
                    self.flags.update(_table_flags(node, tree))
                elif kind is ast.Call and top is not None:
                    # object.__setattr__(self, "x", ...) in a frozen dataclass
                    f, args = node.func, node.args
                    if type(f) is ast.Attribute and f.attr == "__setattr__" and len(args) > 1:
                        if type(args[1]) is ast.Constant:
                            top.members.add(str(args[1].value))

    def _read_test(self, rel: str) -> None:
        """The tests' helpers the docs may name (``entry_point_train``), the variables they
        read (``STARTRAIL_ALLOW_SKIPS``) and pytest's flags (``--lane``, conftest.py)."""
        text = self.text(rel)
        for name in re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", text, re.M):
            self.known.add(name)
            self.defs.setdefault(name, []).append(_Def(any_kwargs=True))
        self.env.update(_UPPER.findall(text))
        if rel == "tests/conftest.py":
            self.flags.update(re.findall(r"[\"'](--[A-Za-z][\w-]*)[\"']", text))

    def _read_shell(self, rel: str) -> None:
        lines = self.text(rel).splitlines()
        text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
        self.flags.update(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text))
        self.env.update(_UPPER.findall(text))

    def _read_setup(self) -> None:
        for node in ast.walk(ast.parse(self.text("setup.py"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = re.fullmatch(r"\s*(startrail-[\w-]+)\s*=\s*([\w.]+):(\w+)\s*", node.value)
                if m:
                    self.commands[m.group(1)] = f"{m.group(2)}.{m.group(3)}"
        pyproject = self.text("pyproject.toml") if "pyproject.toml" in self.files else ""
        for m in re.finditer(r'^\s*"(\w+)[(:]', pyproject, re.M):  # pytest's markers
            self.known.add(m.group(1))
            self.defs.setdefault(m.group(1), []).append(_Def(any_kwargs=True))

    # resolving

    def resolve(self, mod: str, rest: list[str], seen: frozenset = frozenset()) -> str | None:
        """None if ``mod.rest...`` exists, else why not."""
        if not rest:
            return None
        head, tail = rest[0], rest[1:]
        info = self.modules[mod]
        if f"{mod}.{head}" in self.modules:
            return self.resolve(f"{mod}.{head}", tail, seen)
        if head in info.lazy:
            target = info.lazy[head]
            if target not in self.modules or head not in self.modules[target].names:
                return f"{mod}'s lazy table sends {head} to {target}, which does not define it"
            return self.resolve(target, rest, seen)
        if head.endswith("*"):
            names = info.names | set(info.lazy)
            names |= {m.rpartition(".")[2] for m in self.modules if m.startswith(mod + ".")}
            if any(fnmatch.fnmatchcase(n, head) for n in names):
                return None
            return f"nothing in {mod} matches {head}"
        if head not in info.names:
            return f"{mod} has no {head}"
        if not tail:
            return None
        target = info.imports.get(head)
        if target is not None and (mod, head) not in seen:
            if target.split(".")[0] != PKG:
                return None  # an external module's or class's attribute
            return self.resolve(PKG, target.split(".")[1:] + tail, seen | {(mod, head)})
        if head in info.classes:
            return self.member(head, tail[0])
        return f"{mod}.{head} is neither a module nor a class: it has no {tail[0]}"

    def member(self, cls: str, name: str, seen: frozenset = frozenset()) -> str | None:
        """None if a class named ``cls`` (or a base of it of ours) has ``name``."""
        for c in self.classes.get(cls, []):
            if name in c.members:
                return None
            for base in c.bases:
                if base in self.classes and base not in seen:
                    if self.member(base, name, seen | {cls}) is None:
                        return None
        return f"class {cls} has no member {name}"


def _read_module(mod: _Module, tree: ast.Module, is_main: bool) -> None:
    """The top-level names of a module of ours, its imports and its lazy name table."""
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    mod.runnable = is_main
    tables = []
    for node in _top_level(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.names.add(node.name)
            if isinstance(node, ast.ClassDef):
                mod.classes.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            mod.names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if isinstance(node.value, ast.Dict):
                tables.append(node.value)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join(up[: len(up) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                mod.names.add(a.asname or a.name)
                mod.imports[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                alias = a.asname or a.name.split(".")[0]
                mod.names.add(alias)
                mod.imports[alias] = a.name if a.asname else alias
        elif isinstance(node, ast.If) and _is_main_guard(node.test):
            mod.runnable = True
    if "__getattr__" in mod.names:
        # a lazy name table (PEP 562): {"name": ".module"}, imported on first use
        for table in tables:
            pairs = [(k, v) for k, v in zip(table.keys, table.values)]
            if pairs and all(
                isinstance(x, ast.Constant) and isinstance(x.value, str) for p in pairs for x in p
            ):
                for k, v in pairs:
                    mod.lazy[k.value] = f"{package}.{v.value.lstrip('.')}"


def _top_level(tree: ast.Module):
    """A module's top-level statements, with those under ``if`` and ``try``."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.If) and not _is_main_guard(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            todo += [s for h in node.handlers for s in h.body]
        yield node


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _table_strings(tree: ast.Module) -> set[int]:
    """The strings of ``__all__`` and of lazy name tables: they name a thing, not define it."""
    out: set[int] = set()
    lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if "__all__" in names or (lazy and isinstance(node.value, ast.Dict)):
                out.update(id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant))
    return out


def _table_flags(loop: ast.For, tree: ast.Module) -> set[str]:
    """The flags ``for f in TABLE: p.add_argument(f"--{f.replace('_', '-')}")`` defines:
    the strings of TABLE (a module-level tuple, list or set, or a dict's keys), so formatted."""
    names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    table = loop.iter
    if isinstance(table, ast.Call) and isinstance(table.func, ast.Attribute):
        table = table.func.value  # TABLE.items(), TABLE.keys()
    formats = [
        node.values[1].value
        for node in ast.walk(loop)
        if isinstance(node, ast.JoinedStr)
        and len(node.values) == 2
        and isinstance(node.values[0], ast.Constant)
        and node.values[0].value == "--"
        and {n.id for n in ast.walk(node.values[1]) if isinstance(n, ast.Name)} & names
    ]
    if not formats or not isinstance(table, ast.Name):
        return set()
    value = None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == table.id for t in targets):
                value = node.value
    items = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", [])
    out = set()
    for item in items:
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            for f in formats:
                text = item.value
                if (
                    isinstance(f, ast.Call)
                    and isinstance(f.func, ast.Attribute)
                    and f.func.attr == "replace"
                    and all(isinstance(a, ast.Constant) for a in f.args)
                ):
                    text = text.replace(*(a.value for a in f.args))
                out.add(f"--{text}")
    return out


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> _Def:
    if isinstance(node, ast.ClassDef):
        d = _Def()
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                d.params.add(stmt.target.id)  # a dataclass's or NamedTuple's field
            elif isinstance(stmt, ast.FunctionDef) and stmt.name in ("__init__", "__new__"):
                init = _signature(stmt)
                d.params |= init.params
                d.any_kwargs |= init.any_kwargs
        d.any_kwargs |= not d.params and bool(node.bases)  # a base's constructor
        return d
    a = node.args
    return _Def({x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}, a.kwarg is not None)


def _class(node: ast.ClassDef, module: str) -> _Class:
    """A class and its members in its body (``self.x`` ones are added by the caller)."""
    c = _Class(module)
    c.bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            c.members.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            c.members.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return c


@cache
def project() -> Code:
    return Code(ROOT)


# --- Markdown -------------------------------------------------------------------------


@dataclass
class Page:
    spans: list[tuple[int, str]] = field(default_factory=list)  # (line, code span)
    code: list[tuple[int, str]] = field(default_factory=list)  # (line, code block line)
    links: list[tuple[int, str]] = field(default_factory=list)  # (line, target)
    headings: list[str] = field(default_factory=list)


_LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])(\s+)")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}#{1,6}(?:\s+|$)")
_TICKS = re.compile(r"`+")
_LINK = re.compile(
    r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"  # [text](target), ![alt](..)
    r"|<img\b[^>]*\bsrc=[\"']([^\"']+)[\"']"
    r"|<a\b[^>]*\bhref=[\"']([^\"']+)[\"']"
    r"|^\[[^\]]+\]:\s*<?([^\s>]+)",  # [ref]: target
    re.M,
)


def parse_markdown(text: str) -> Page:
    """Code spans (per paragraph, so that one may cross lines), the lines of code blocks
    (fenced, or indented 4 past the enclosing list item's text), links and headings."""
    page = Page()
    para: list[tuple[int, str]] = []
    fence = None
    list_indent = None  # the text column of the list item we are in
    blank = True  # the line before was blank
    for no, line in enumerate(text.split("\n"), 1):
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            else:
                page.code.append((no, line))
            continue
        if not line.strip():
            _inline(para, page)
            blank = True
            continue
        indent = len(line) - len(line.lstrip(" "))
        base = list_indent or 0
        m = _FENCE.match(line)
        if m and indent < base + 4:
            _inline(para, page)
            fence = m.group(1)
            continue
        code_before = bool(page.code) and page.code[-1][0] == no - 1
        if not para and indent >= base + 4 and (blank or code_before):
            page.code.append((no, line))
            blank = False
            continue
        item = _LIST_ITEM.match(line)
        if item:
            _inline(para, page)
            list_indent = sum(len(g) for g in item.groups())
        elif blank and indent < base:
            list_indent = None
        if _HEADING.match(line):
            _inline(para, page)
            heading = line.lstrip().lstrip("#").strip()
            page.headings.append(heading)
            _inline([(no, heading)], page)
        else:
            para.append((no, line.strip()))
        blank = False
    _inline(para, page)
    return page


def _inline(para: list[tuple[int, str]], page: Page) -> None:
    """A paragraph's code spans (CommonMark: a run of n backticks up to the next run of
    exactly n) and its links outside them; empties ``para``."""
    if not para:
        return
    text = "\n".join(t for _, t in para)
    first = para[0][0]
    para.clear()
    prose = []
    pos = 0
    runs = list(_TICKS.finditer(text))
    i = 0
    while i < len(runs):
        opener = runs[i]
        n = len(opener.group())
        close = next((j for j in range(i + 1, len(runs)) if len(runs[j].group()) == n), None)
        if close is None or text[opener.start() - 1 : opener.start()] == "\\":
            i += 1
            continue
        body = text[opener.end() : runs[close].start()].replace("\n", " ")
        if body.startswith(" ") and body.endswith(" ") and body.strip():
            body = body[1:-1]
        page.spans.append((first + text.count("\n", 0, opener.start()), body))
        # the span's newlines kept, so that the links' lines stay right
        prose.append(text[pos : opener.start()] + "\n" * body.count("\n"))
        pos = runs[close].end()
        i = close + 1
    rest = "".join(prose) + text[pos:]
    for m in _LINK.finditer(rest):
        target = next(g for g in m.groups() if g is not None)
        page.links.append((first + rest.count("\n", 0, m.start()), target))


def _slugs(headings: list[str]) -> set[str]:
    """GitHub's anchors for a page's headings (a repeated one gets -1, -2, ...)."""
    out: set[str] = set()
    for h in headings:
        slug = re.sub(r"[^\w\- ]", "", h.replace("`", "").strip().lower()).replace(" ", "-")
        k, s = 0, slug
        while s in out:
            k += 1
            s = f"{slug}-{k}"
        out.add(s)
    return out


# --- the checks -----------------------------------------------------------------------

_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*\*?")
_COMMAND = re.compile(r"(?<![\w.-])startrail-[a-z][\w-]*(?![+{])")
_RUN_MODULE = re.compile(r"(?<![\w-])(?:-m|--module)\s+([A-Za-z_][\w.]*)")
_ENV = re.compile(r"\bSTARTRAIL_[A-Z0-9_]+\b")
_QUALIFIED = re.compile(
    rf"(?<![\w.])(?:st|{PKG})(?:\.[A-Za-z_]\w*)+(?:\.\*)?(\((?:[^()]|\([^()]*\))*\))?"
)
_FROM_IMPORT = re.compile(rf"\bfrom\s+({PKG}[\w.]*)\s+import\s+\(?([\w, ]+)")
_REPO_DIRS = ("scripts/", "configs/", "docs/", "tests/", "patches/", f"{PKG}/", ".ci/")


class Checker:
    def __init__(self, code: Code):
        self.code = code

    def check(self, text: str, page: str) -> list[str]:
        """Every problem of the page ``page`` (its path from the root) reading ``text``."""
        md = parse_markdown(text)
        folder = "" if "/" not in page else page.rsplit("/", 1)[0] + "/"
        out: list[str] = []
        for line, span in md.spans:
            for why in dict.fromkeys(self.span(span.strip(), folder)):
                out.append(f"{page}:{line}: `{span}`: {why}")
        for line, code in md.code:
            for bad, why in dict.fromkeys(self.commands(code, names=True)):
                out.append(f"{page}:{line}: `{bad}` (code block): {why}")
        for line, target in md.links:
            why = self.link(target, folder, md.headings)
            if why:
                out.append(f"{page}:{line}: link ({target}): {why}")
        return sorted(out, key=lambda p: int(p[len(page) + 1 :].split(":")[0]))

    def span(self, s: str, folder: str) -> list[str]:
        single = _single(s, self.code.files)
        names = single is None or single[0] == "keyword"
        found = self.commands(s, names, checked=s if single else None)
        out = [why if bad == s else f"`{bad}`: {why}" for bad, why in found]
        if single is not None:
            kind, value, args = single
            if kind == "path":
                why = self.path(value, folder)
            elif kind == "test":
                why = self.test(value)
            elif kind == "keyword":
                why = self.keyword(value, args)
            else:
                why = self.name(value, args)
            if why:
                out.append(why)
        return out

    def commands(self, text: str, names: bool, checked: str | None = None) -> list[tuple[str, str]]:
        """Flags, ``startrail-*`` commands, ``-m`` modules, STARTRAIL_* variables and paths
        under the repository's folders (but ``checked``) in a line; with ``names``, st. /
        startrail_megatron. names and Python's imports from the package."""
        c = self.code
        out = []
        for m in _FLAG.finditer(text):
            flag = m.group()
            if flag.endswith("*"):
                if not any(fnmatch.fnmatchcase(f, flag) for f in c.flags):
                    out.append((flag, "no flag of ours matches"))
            elif flag not in c.flags and flag not in EXTERNAL_FLAGS:
                out.append((flag, "no such flag in the code (nor another tool's we list)"))
        for m in _COMMAND.finditer(text):
            target = c.commands.get(m.group())
            if target is None:
                out.append((m.group(), "not a console script of setup.py"))
            elif self.name(target, None):
                out.append((m.group(), f"setup.py's target {target} does not exist"))
        for m in _RUN_MODULE.finditer(text):
            mod = m.group(1).rstrip(".")
            if mod.split(".")[0] == PKG:
                info = c.modules.get(mod)
                if info is None:
                    out.append((mod, "no such module"))
                elif not (info.runnable or f"{mod}.__main__" in c.modules):
                    out.append((mod, "not runnable: no __main__ guard nor __main__.py"))
        for m in _ENV.finditer(text):
            if m.group() not in c.env:
                out.append((m.group(), "environment variable not in the code"))
        for tok in text.split():
            tok = tok.strip("\"'`,;()[]").split("::")[0]  # a pytest node id's file
            if tok.startswith(_REPO_DIRS) and not _placeholder(tok) and tok != checked:
                why = self.path(tok, "")
                if why:
                    out.append((tok, why))
        if names:
            for m in _QUALIFIED.finditer(text):
                name = m.group()[: m.start(1) - m.start()] if m.group(1) else m.group()
                why = self.name(name, m.group(1)[1:-1] if m.group(1) else None)
                if why:
                    out.append((name, why))
            for m in _FROM_IMPORT.finditer(text):
                if any(bad == m.group(1) for bad, _ in out):
                    continue  # the module itself is reported
                for n in m.group(2).split(","):
                    n = f"{m.group(1)}.{n.split(' as ')[0].strip()}"
                    why = None if n.endswith(".") else self.name(n, None)
                    if why:
                        out.append((n, why))
        first: dict[str, str] = {}
        for bad, why in out:
            first.setdefault(bad, why)  # one reason per thing
        return list(first.items())

    def path(self, p: str, folder: str) -> str | None:
        c = self.code
        p = p.rstrip(".,:;")
        if p.startswith(OUTSIDE):
            return "points outside the repository"
        if p in GENERATED_PATHS or p in EXTERNAL_PATHS:
            return None
        if "/" not in p.rstrip("/"):  # a bare name: anywhere in the repository
            if p in c.basenames or any(fnmatch.fnmatchcase(b, p) for b in c.basenames if "*" in p):
                return None
            return "no such file or folder in the repository"
        for base in ("", folder, f"{PKG}/"):
            want = os.path.normpath(base + p).replace(os.sep, "/") + ("/" if p[-1] == "/" else "")
            if want in c.files or f"{want}/" in c.files:
                return None
            if "*" in want and any(fnmatch.fnmatchcase(f, want) for f in c.files):
                return None
        return "no such path (from the root, the page's folder or startrail_megatron/)"

    def test(self, value: str) -> str | None:
        """``tests/test_x.py::test_y`` (or ``test_x.py::test_y``) names a test."""
        path, _, name = value.partition("::")
        found = [f for f in self.code.files if f == path or f.endswith("/" + path)]
        if not found:
            return f"no file {path}"
        for f in found:
            if re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(", self.code.text(f), re.M):
                return None
        return f"{path} has no test {name}"

    def link(self, target: str, folder: str, headings: list[str]) -> str | None:
        """A relative link's file exists, and its anchor is a heading of the page it names
        (``#anchor`` alone: of this page, whose ``headings`` are given)."""
        if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith("//"):
            return None  # http(s), mailto: not checked
        path, _, anchor = target.partition("#")
        rel = os.path.normpath(folder + path).replace(os.sep, "/") if path else None
        if rel is not None:
            if rel.startswith(OUTSIDE) or rel == "..":
                return "points outside the repository"
            if rel not in self.code.files and f"{rel}/" not in self.code.files:
                return "no such file"
        if anchor and (rel is None or rel.endswith(".md")):
            if rel is not None:
                headings = parse_markdown(self.code.text(rel)).headings
            if anchor not in _slugs(headings):
                return f"no heading #{anchor} in {rel or 'this page'}"
        return None

    def keyword(self, name: str, value: str) -> str | None:
        """``name=value``: an environment variable (upper case), or a keyword or field."""
        if name.isupper():
            if name.startswith("STARTRAIL_") or name in self.code.env or name in EXTERNAL_ENV:
                return None  # STARTRAIL_* is checked with every line
            return f"environment variable {name} not in the code (nor another tool's we list)"
        why = self.name(name, None)
        inner = _single(value.strip(), self.code.files)
        if not why and inner and inner[0] == "name" and inner[2] is not None:
            if "." not in inner[1]:
                why = self.name(inner[1], inner[2])  # ``comm_options=CommOptions(x=...)``
        return why

    def name(self, name: str, args: str | None) -> str | None:
        c = self.code
        parts = name.split(".")
        if parts[0] == "st":
            parts[0] = PKG
        if parts[0] == PKG:
            return c.resolve(PKG, parts[1:]) or self.kwargs(parts, args)
        if _external(name):
            return None
        if len(parts) == 1:
            n = parts[0]
            if args is not None:
                if n in c.defs or n in _BUILTINS or n in EXTERNAL_NAMES:
                    return self.kwargs(parts, args)
                return f"no function or class {n} in the code"
            if not _looks_like_code(n) or n in _BUILTINS or n in EXTERNAL_NAMES:
                return None
            if n in c.known or n in c.strings or n in c.env:
                return None
            if "*" in n and any(fnmatch.fnmatchcase(k, n) for k in c.known | c.strings):
                return None
            return f"{n} is defined nowhere in the code (nor an external name we list)"
        # a dotted name relative to one of our modules, or a class's member
        why = None
        for k in range(len(parts) - 1, 0, -1):
            mods = sorted(c.suffixes.get(".".join(parts[:k]), []), key=len)
            if mods:
                whys = [c.resolve(m, parts[k:]) for m in mods]
                if None in whys:
                    return self.kwargs(parts, args)
                why = whys[0]
                break
        if parts[0] in c.classes and len(parts) == 2:
            member = c.member(parts[0], parts[1])
            if member is None:
                return self.kwargs(parts, args)
            why = why or member
        if parts[0] in EXTERNAL_NAMES:
            return None
        if len(parts) == 2 and parts[0][0].islower():
            # ``tokens.gather(x)``, ``layout.placement_targets``: an object's member, of a
            # class of the module the object is named after if there is one, else of any
            mods = set(c.suffixes.get(parts[0], []))
            for classes in c.classes.values():
                for cl in classes:
                    if parts[1] in cl.members and (not mods or cl.module in mods):
                        return None
        why = why or f"{parts[0]} is no module nor class of ours"
        if parts[0] in ("megatron", "deepspeed"):
            why += f" (upstream's? see EXTERNAL_{parts[0].upper()})"
        return why

    def kwargs(self, parts: list[str], args: str | None) -> str | None:
        """A call's keyword arguments are parameters of a function or class of its name."""
        keys = [m.group(1) for a in _split_args(args or "") if (m := re.match(r"\s*(\w+)\s*=", a))]
        defs = self.code.defs.get(parts[-1], [])
        if not keys or not defs or any(d.any_kwargs for d in defs):
            return None
        if any(all(k in d.params for k in keys) for d in defs):
            return None
        missing = sorted({k for k in keys if not any(k in d.params for d in defs)})
        return f"{'.'.join(parts)} takes no keyword {', '.join(missing)}"


def _single(s: str, files: set[str]) -> tuple[str, str, str | None] | None:
    """(kind, value, call arguments or value) of a span that is one thing: a path, a test,
    a name (dotted, maybe called or subscripted) or ``name=value``; else None."""
    if "://" in s or s.startswith("-"):
        return None
    if re.fullmatch(r"[\w./*-]+\.py::\w+", s):
        return ("test", s, None)
    if re.fullmatch(r"[\w.@~$/*<>{}-]+", s) and ("/" in s or re.search(rf"\.({_EXTENSIONS})$", s)):
        if s.startswith(("~", "$", "/")) or _placeholder(s) or re.search(r"[<>{}]|\.\.\.", s):
            return None  # a home, a variable, an absolute path or a placeholder
        if re.fullmatch(r"\.\w+", s):
            return None  # ``.png``: a suffix
        last = s.rstrip("/").rsplit("/", 1)[-1]
        if "/" in s.rstrip("/") and not s.endswith("/") and "." not in last and "*" not in last:
            # ``calls/rank``, ``2BNH/C``: a path only if its first folder is one of ours
            first = s.split("/", 1)[0] + "/"
            if first not in files and f"{PKG}/{first}" not in files:
                return None
        return ("path", s, None)
    m = re.fullmatch(r"([A-Za-z_]\w*)\s*=(?!=)\s*(.*)", s, re.S)
    if m:
        return ("keyword", m.group(1), m.group(2))
    m = re.fullmatch(
        r"([A-Za-z_]\w*\*?(?:\.(?:[A-Za-z_]\w*\*?|\*))*)\s*(?:\((.*)\))?(?:\[.*\])?", s
    )
    if m:
        return ("name", m.group(1), m.group(2))
    return None  # values, expressions, prose, suffixes (``.launch``)


def _placeholder(p: str) -> bool:
    return any(part in PLACEHOLDERS or part.split(".")[0] in PLACEHOLDERS for part in p.split("/"))


def _external(name: str) -> bool:
    parts = name.split(".")
    if parts[0] in EXTERNAL_ROOTS or parts[0] in sys.stdlib_module_names:
        return True
    if parts[0] == "megatron" and len(parts) > 1 and parts[1] in EXTERNAL_MEGATRON:
        return True
    return any(name == e or name.startswith(e + ".") for e in EXTERNAL_DEEPSPEED)


def _looks_like_code(n: str) -> bool:
    """snake_case, CamelCase, camelCase or an UPPER_CASE constant: a name, not a word."""
    if n.startswith("__") and n.endswith("__"):
        return False
    return bool(
        re.search(r"[A-Za-z0-9]_[A-Za-z0-9*]", n)
        or re.fullmatch(r"_?[A-Z]\w*[a-z]\w*|[a-z]+[A-Z]\w*", n)
        or (n.isupper() and len(n) >= 4)
    )


def _split_args(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def check_markdown(text: str, page: str, code: Code | None = None) -> list[str]:
    """Every problem of a page (``page``: its path from the repository root)."""
    return Checker(code or project()).check(text, page)


# --- the tests ------------------------------------------------------------------------


@pytest.mark.parametrize("page", _pages())
def test_the_docs_name_only_what_exists(page):
    problems = check_markdown((ROOT / page).read_text(encoding="utf-8"), page)
    if problems:
        pytest.fail(f"{len(problems)} stale in {page}:\n" + "\n".join(problems), pytrace=False)


BAD_PAGE = """\
# A page with one stale thing per line

Call `st.startrail_attentionX(q, k, v, groups)` and
`startrail_megatron.schedule.layout.plan_stepX`; then `schedule.plan_stepX` and
`StarTrailLayout.ring_shiftX`, `zigzag_shardX`, `uninstallX()`, `KVRing.heldX`.
Keywords: `startrail_attention(q, k, v, groups, windowX=(8, 0))`, `lay = st.pack_lengthsX(n)`.
A flag `--startrail-team-sizeX 2`, `--lr-warmupX-*` and `STARTRAIL_KERNELX=torch`.
Paths: `schedule/layoutX.py`, `docs/no_such_page.md`, `test_megatronX*.py`,
`tests/test_imports.py::test_no_such_test`; `startrail-planX --help`; `--cp-sizeX=8`.

    python -m startrail_megatron.no_such_module --nprocX 4
    startrail-bench --emulateX 4x2
    scripts/no_such_script.sh

```python
import startrail_megatron as st
from startrail_megatron.schedule import plan_stepX
out = st.startrail_attentionY(q, k, v, groups, causal=True)
```

![a figure](no_such_figure.png) and [a section](architecture.md#no-such-heading) and
<img src="nowhere.png">, [above](#no-such-heading-here).
The spec: `../shared/reference/SPEC.md`, [the spec](../../shared/reference/SPEC.md).
"""

STALE = [
    (
        "`st.startrail_attentionX(q, k, v, groups)`",
        "startrail_megatron has no startrail_attentionX",
    ),
    ("`startrail_megatron.schedule.layout.plan_stepX`", "has no plan_stepX"),
    ("`schedule.plan_stepX`", "startrail_megatron.schedule has no plan_stepX"),
    ("`StarTrailLayout.ring_shiftX`", "no member ring_shiftX"),
    ("`zigzag_shardX`", "defined nowhere"),
    ("`uninstallX()`", "no function or class uninstallX"),
    ("`KVRing.heldX`", "no member heldX"),
    ("windowX=(8, 0))`", "takes no keyword windowX"),
    ("`lay = st.pack_lengthsX(n)`: `st.pack_lengthsX`", "startrail_megatron has no pack_lengthsX"),
    ("`--startrail-team-sizeX`", "no such flag"),
    ("`--lr-warmupX-*`", "no flag of ours matches"),
    ("`schedule/layoutX.py`", "no such path"),
    ("`docs/no_such_page.md`", "no such path"),
    ("`test_megatronX*.py`", "no such file"),
    ("test_no_such_test`", "has no test test_no_such_test"),
    ("`startrail-planX`", "not a console script"),
    ("`--cp-sizeX`", "no such flag"),
    ("`startrail_megatron.no_such_module` (code block)", "no such module"),
    ("`STARTRAIL_KERNELX=torch`: `STARTRAIL_KERNELX`", "environment variable not in the code"),
    ("`--nprocX` (code block)", "no such flag"),
    ("`--emulateX` (code block)", "no such flag"),
    ("`scripts/no_such_script.sh` (code block)", "no such path"),
    ("`startrail_megatron.schedule.plan_stepX` (code block)", "has no plan_stepX"),
    ("`st.startrail_attentionY` (code block)", "has no startrail_attentionY"),
    ("link (no_such_figure.png)", "no such file"),
    ("link (architecture.md#no-such-heading)", "no heading #no-such-heading"),
    ("link (nowhere.png)", "no such file"),
    ("link (#no-such-heading-here)", "no heading #no-such-heading-here in this page"),
    ("`../shared/reference/SPEC.md`", "points outside the repository"),
    ("link (../../shared/reference/SPEC.md)", "points outside the repository"),
]

GOOD_PAGE = """\
# The same page, right

Call `st.startrail_attention(q, k, v, groups, causal=True)` and
`startrail_megatron.schedule.layout.StarTrailLayout`; then `schedule.plan_step` and
`StarTrailLayout.ring_shift`, `zigzag_shard`, `uninstall()`, `KVRing.held`,
`st.CommLedger.bytes_by_link`, `split_comm_*`, `megatron.install(team_size=2)`.
Keywords: `startrail_attention(q, k, v, groups, window=(8, 0), softcap=)`,
`lay = st.pack_lengths([2039, 1013], cp_size)`, `ledger=st.CommLedger()`.
A flag `--startrail-team-size 2`, `--lr-warmup-*`, `--startrail-placement {team,ring}`,
`STARTRAIL_KERNEL=torch`, `--tokenizer-model DIR`, `--cluster-json REPORT.json`.
Paths: `schedule/layout.py`, `docs/performance.md`, `test_megatron*.py`, `te/`,
`tests/test_imports.py::test_no_import_circle`; `startrail-plan --help`; `--cp-size=8`.
External: `torch.cuda.synchronize`, `megatron.legacy.model`, `get_batch_on_this_cp_rank`,
`GPTModel`, `sys.argv`, `~/.cache/uv`, `[s, b, h, d]`, `"auto"`, `ring`, `.png`.

    python -m startrail_megatron.demo --nproc 4 --data-path data/corpus \\
        --context-parallel-size 4 --startrail-team-size 2
    startrail-bench --emulate 4x2 --inter-node 200mbit
    .venv/bin/torchrun --nproc-per-node 4 -m startrail_megatron.launch \\
        scripts/train_tiny_llama.py --deepspeed_config configs/startrail_deepspeed.json

```python
import startrail_megatron as st
from startrail_megatron.schedule import plan_step, StarTrailLayout as Layout
out = st.startrail_attention(q, k, v, groups, causal=True)
```

![a figure](bench_cpu_p4.png) and [a section](architecture.md#architecture),
<img src="bench_cpu_p8.png">, [the web](https://example.com/x.md), [above](#the-same-page-right).
"""


def test_the_checker_flags_what_does_not_exist():
    problems = check_markdown(BAD_PAGE, "docs/bad.md")
    for what, why in STALE:
        assert any(what in p and why in p for p in problems), (what, why, problems)
    assert len(problems) == len(STALE), "\n".join(problems)
    assert all(re.match(r"docs/bad\.md:\d+: ", p) for p in problems)


def test_the_checker_accepts_what_exists():
    assert check_markdown(GOOD_PAGE, "docs/good.md") == []


def test_the_checker_reads_markdown_like_github():
    page = parse_markdown(
        "Text `one\n  span` and ``a `tick` here``, \\`not a span`.\n"
        "- item\n\n    still the item's text `two`\n\n"
        "      item code --six\n\n"
        "Para\n    lazy continuation `three`\n\n"
        "    block --four\n"
        "```\n--five `no span`\n```\n"
        "## A `code` heading!\n## A `code` heading!\n"
    )
    assert page.spans == [
        (1, "one span"),
        (2, "a `tick` here"),
        (5, "two"),
        (10, "three"),
        (16, "code"),
        (17, "code"),
    ]
    assert page.code == [
        (7, "      item code --six"),
        (12, "    block --four"),
        (14, "--five `no span`"),
    ]
    assert _slugs(page.headings) == {"a-code-heading", "a-code-heading-1"}
    # a span's line is where it opens; a problem names it
    problems = check_markdown("x\n\nsee `st.no_such`\nand\n`--no-such-flag`.\n", "README.md")
    assert [p.split(": ")[0] for p in problems] == ["README.md:3", "README.md:5"]


def test_a_renamed_function_fails_the_pages_that_name_it():
    """``zigzag_shard`` renamed where it is defined (``startrail_megatron/zigzag.py``, read
    from an edited copy): each page naming it in a span or a command fails, naming it; the
    root's lazy table, which still lists it, no longer resolves ``st.zigzag_shard``."""
    code = project()
    zigzag = f"{PKG}/zigzag.py"
    text = code.text(zigzag)
    assert "def zigzag_shard(" in text
    edited = Code(ROOT, {zigzag: text.replace("def zigzag_shard(", "def zigzag_shard_v2(")})
    naming = []
    for page in _pages():
        md_text = (ROOT / page).read_text(encoding="utf-8")
        md = parse_markdown(md_text)
        lines = [s.strip() for _, s in md.spans if _single(s.strip(), code.files)]
        lines += [c for _, c in md.code if re.search(r"\bst\.zigzag_shard\b", c)]
        if any(re.search(r"\bzigzag_shard\b", s) for s in lines):
            naming.append(page)
            stale = [p for p in check_markdown(md_text, page, edited) if "zigzag_shard" in p]
            assert stale, f"{page} names zigzag_shard, yet passes with it renamed"
    assert naming, "no page names zigzag_shard any more: rename a function the docs name"
    problems = check_markdown("`st.zigzag_shard(x, r, p)` and `zigzag_shard`", "README.md", edited)
    assert len(problems) == 2, problems
    assert "lazy table sends zigzag_shard to startrail_megatron.zigzag" in problems[0]
    assert "zigzag_shard is defined nowhere" in problems[1]


def test_this_file_imports_no_code():
    """Pure: the standard library and pytest only (no torch, megatron-core, DeepSpeed, nor
    anything of ours, which conftest.py may have imported already)."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    imported = {
        (a.name if isinstance(n, ast.Import) else n.module).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    assert imported - {"__future__", "pytest"} <= set(sys.stdlib_module_names), imported
