#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs the pinned
# dependencies of constraints.txt for the interpreter's test lane: Python 3.11 gets
# megatron-core 0.16, Python 3.12 megatron-core 0.19 (every release from 0.17 needs 3.12).
# Usage: bash scripts/setup_env.sh   (PYTHON=interpreter, VENV=path to use others)
#
# The installer is uv (pinned in constraints.txt, installed into the venv by pip): it keeps
# every wheel it unpacked in its cache (~/.cache/uv, or UV_CACHE_DIR) and links them into a
# new venv, and the bytecode compiled once is linked too (below), so a fresh clone on a
# machine that installed once sets up in ~9 s per lane (29 - 33 s with new pins), where pip
# took 85 s (3.11) and 127 s (3.12) unpacking and byte-compiling again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
# The venv is made without ensurepip's pip (it byte-compiles pip's own files: 3 - 11 s a lane);
# uv is installed into it by the interpreter's pip where that has ``--python`` (pip >= 22.3),
# else by ensurepip's, and the venv's pip comes from uv below, at its pin.
[ -x "$VENV/bin/python" ] || "$PY" -m venv --without-pip "$VENV"
UV_PIN=$(grep -E '^uv==' constraints.txt)
if ! "$VENV/bin/uv" --version 2>/dev/null | grep -q "^uv ${UV_PIN#uv==}\b"; then
    "$PY" -m pip --python "$VENV/bin/python" --disable-pip-version-check -q install "$UV_PIN" \
        2>/dev/null || {
        "$VENV/bin/python" -m ensurepip >/dev/null
        "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$UV_PIN"
    }
fi
# pip's configured extra wheel folders (PIP_FIND_LINKS, whitespace-separated) are uv's too:
# our CI machines keep a CPU build of torch 2.13.0 for 3.11 there (elsewhere PyPI's build).
if [ -n "${PIP_FIND_LINKS:-}" ] && [ -z "${UV_FIND_LINKS:-}" ]; then
    UV_FIND_LINKS=$(echo "$PIP_FIND_LINKS" | tr -s ' \t' ',,')
    export UV_FIND_LINKS
fi
# Bytecode: not uv's --compile-bytecode (every file of every package, torch's thousands
# nobody imports: 50 - 60 CPU s per lane) but what the project imports, compiled by
# importing it once (scripts/compile_imports.py, ~25 CPU s), at the end. Without either,
# where PYTHONDONTWRITEBYTECODE is set (as on the CI machines), every new interpreter
# compiles torch and megatron-core again (their import 20 s instead of 7 s).
UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c constraints.txt)
"${UV[@]}" pip  # the venv's own pip (users', and the wheelhouse's download below)
# torch alone and first, from the pin: never let a dependency pull a second build.
if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    # Python >= 3.12: only a CUDA build of torch exists (several GB, with its CUDA
    # libraries). Downloaded once into a wheelhouse kept outside the clone, installed
    # from there with no index.
    WHEELS=${STARTRAIL_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/startrail_megatron/wheels}
    mkdir -p "$WHEELS"
    if ! "${UV[@]}" --no-index --find-links "$WHEELS" torch 2>/dev/null; then
        "$VENV/bin/python" -m pip --disable-pip-version-check -q download \
            -c constraints.txt -d "$WHEELS" torch
        "${UV[@]}" --no-index --find-links "$WHEELS" torch
    fi
else
    "${UV[@]}" torch
fi
DS_BUILD_OPS=0 "${UV[@]}" -e ".[dev,megatron,deepspeed]"
# Compiled once per interpreter and pins: the bytecode of the files linked from uv's cache is
# kept (scripts/bytecode_cache.py) and given to the next fresh venv, linked where the source
# is the very file it was compiled from, else compiled from it (~1.5 s, not ~19 s); where a
# cached module's source is gone, everything is compiled by importing and saved anew.
stamp=$(cat constraints.txt pyproject.toml setup.py scripts/compile_imports.py \
    scripts/bytecode_cache.py tests/harness.py | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.compiled_imports" 2>/dev/null)" != "$stamp" ]; then
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    TAG=$("$VENV/bin/python" -c 'import sys; print(sys.implementation.cache_tag)')
    CACHE=${XDG_CACHE_HOME:-${HOME:+$HOME/.cache}}
    BYTECODE=${CACHE:+$CACHE/startrail_megatron/bytecode/$TAG-$stamp}
    if [ -n "$BYTECODE" ] &&
        "$VENV/bin/python" scripts/bytecode_cache.py restore "$SITE" "$BYTECODE"; then
        # the project's own modules (the clone's files, not cached): 0.2 s
        env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -m compileall -q startrail_megatron
    else
        env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" scripts/compile_imports.py
        [ -z "$BYTECODE" ] || "$VENV/bin/python" scripts/bytecode_cache.py save "$SITE" "$BYTECODE"
    fi
    echo "$stamp" >"$VENV/.compiled_imports"
fi
