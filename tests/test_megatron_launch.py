"""The Megatron-LM hooks: extra_args_provider chaining and the launcher, on a stand-in tree.

Megatron-LM's training package is not installable here, so the launcher runs a
stand-in ``megatron.training`` with the same ``parse_args(extra_args_provider,
ignore_unknown_args)`` contract; the real core_r0.16.0 tree was checked by hand
(README, "Upstream Megatron-LM").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

from startrail_megatron.megatron import hooks  # noqa: E402
from startrail_megatron.megatron.arguments import extra_args_provider  # noqa: E402


def _parser(chain=None):
    p = argparse.ArgumentParser(prog="pretrain_gpt.py")
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=64)
    # as Megatron-LM core_r0.16.0 adds them (TransformerConfig / ModelParallelConfig / logger)
    for flag in (
        "--qk-clip",
        "--log-max-attention-logit",
        "--hybrid-context-parallel",
        "--dynamic-context-parallel",  # Megatron-LM's dev branch (no release up to 0.19)
        "--reset-attention-mask",
        "--reset-position-ids",
    ):
        p.add_argument(flag, action="store_true")
    return extra_args_provider(p, chain=chain)


ST4 = ["--context-parallel-size", "4", "--context-parallel-impl", "startrail"]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (
            ["--startrail-team-size", "auto"],
            "--startrail-team-size auto needs StarTrail's autotuner, which only "
            "'python -m startrail_megatron.pretrain_gpt' runs",
        ),
        (["--qk-clip"], "--qk-clip is not supported with --context-parallel-impl startrail"),
        (
            ["--dynamic-context-parallel"],
            "--dynamic-context-parallel is not supported with --context-parallel-impl startrail: "
            "it is Megatron-LM's dev-branch dynamic CP",
        ),
        (
            ["--log-max-attention-logit"],
            "--log-max-attention-logit is not supported with --context-parallel-impl startrail",
        ),
        (
            [
                "--hybrid-context-parallel",
                "--startrail-team-size",
                "2",
                "--startrail-placement",
                "auto",
            ],
            "--hybrid-context-parallel is not supported with --startrail-placement auto",
        ),  # fmt: skip
        (  # Megatron-LM packs documents with a dense mask StarTrail does not read
            ["--startrail-team-size", "2", "--reset-attention-mask"],
            "--reset-attention-mask makes packed sequences, which StarTrail takes only",
        ),
        (
            ["--startrail-team-size", "2", "--reset-position-ids"],
            "--reset-position-ids makes packed sequences",
        ),
    ],
)
def test_extra_args_provider_refuses_what_it_cannot_honour(flags, needle, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(ST4 + flags)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
    assert hooks.installed_config() is None
    # the same flags without StarTrail's are Megatron's business; StarTrail's own without
    # --context-parallel-impl startrail would be ignored: refused by name
    theirs = [f for i, f in enumerate(flags) if not (
        f.startswith("--startrail-") or i and flags[i - 1].startswith("--startrail-")
    )]  # fmt: skip
    _parser().parse_args(theirs)
    if theirs != flags:
        with pytest.raises(SystemExit):
            _parser().parse_args(flags)
        err = capsys.readouterr().err
        assert "without --context-parallel-impl startrail would be ignored" in err or (
            "--startrail-team-size auto needs StarTrail's autotuner" in err
        ), err


def test_install_from_args_refuses_auto_without_the_autotuner():
    from startrail_megatron.megatron.arguments import install_from_args

    ns = argparse.Namespace(
        context_parallel_impl="startrail", startrail_team_size="auto", startrail_placement="team"
    )
    with pytest.raises(ValueError, match="--startrail-team-size auto needs"):
        install_from_args(ns)
    assert hooks.installed_config() is None


def test_extra_args_provider_validates_and_installs():
    seen = []

    def other(p):
        seen.append("chained")
        p.add_argument("--other", default="x")
        return p

    try:
        args = _parser(other).parse_args(
            [
                "--context-parallel-size",
                "8",
                "--context-parallel-impl",
                "startrail",
                "--startrail-team-size",
                "2",
                "--startrail-placement",
                "ring",
                "--startrail-own-rows-first",
                "on",
                "--other",
                "y",
            ]
        )
        assert seen == ["chained"] and args.other == "y"
        assert hooks.installed_config() == {
            "team_size": 2,
            "placement": "ring",
            "kernel": "auto",
            "own_rows_first": True,
            "ulysses_size": 1,
            "tiled_loss": None,
            "tiled_mlp": None,
            "attention_tile": None,
            "attention_head_chunks": None,
            "placement_shape": None,
            "hybrid_team_sizes": None,
        }
    finally:
        hooks.uninstall()
    assert hooks.installed_config() is None
    # te (the default) installs nothing
    _parser().parse_args(["--context-parallel-size", "8"])
    assert hooks.installed_config() is None


def test_own_rows_first_from_a_namespace_is_checked_by_name():
    from startrail_megatron.megatron.arguments import validate_startrail_args

    ns = argparse.Namespace(
        context_parallel_impl="startrail",
        context_parallel_size=4,
        startrail_team_size=2,
        startrail_placement="team",
        startrail_own_rows_first="sometimes",
    )
    with pytest.raises(ValueError, match=r"--startrail-own-rows-first='sometimes'.*'auto'"):
        validate_startrail_args(ns)
    ns.startrail_own_rows_first = "off"
    validate_startrail_args(ns)


def test_extra_args_provider_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(
            [
                "--context-parallel-size",
                "8",
                "--context-parallel-impl",
                "startrail",
                "--startrail-team-size",
                "4",
            ]
        )
    assert (
        "--startrail-team-size 4 does not fit --context-parallel-size 8" in capsys.readouterr().err
    )
    assert hooks.installed_config() is None


FAKE_ARGUMENTS = """
import argparse

def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=64)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args()[0]
    return parser.parse_args()
"""

FAKE_SCRIPT = """
import json
from megatron.training.initialize import parse_args
from startrail_megatron.megatron import hooks
args = parse_args(None)
print(json.dumps({"impl": args.context_parallel_impl, "installed": hooks.installed_config()}))
"""


@pytest.fixture
def fake_megatron_lm(tmp_path):
    root = tmp_path / "Megatron-LM"
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text(
        "import pkgutil\n__path__ = pkgutil.extend_path(__path__, __name__)\n"
    )
    (root / "megatron" / "training" / "__init__.py").write_text("")
    (root / "megatron" / "training" / "arguments.py").write_text(textwrap.dedent(FAKE_ARGUMENTS))
    (root / "megatron" / "training" / "initialize.py").write_text(
        "from megatron.training.arguments import parse_args\n"
    )
    (root / "pretrain_gpt.py").write_text(textwrap.dedent(FAKE_SCRIPT))
    return root


def _launch(root, *flags):
    return subprocess.run(
        [sys.executable, "-m", "startrail_megatron.launch", str(root / "pretrain_gpt.py"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(root),
    )


def test_launcher_runs_script_with_hooks(fake_megatron_lm):
    res = _launch(
        fake_megatron_lm,
        "--context-parallel-size",
        "4",
        "--context-parallel-impl",
        "startrail",
        "--startrail-team-size",
        "2",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {
        "impl": "startrail",
        "installed": {
            "team_size": 2,
            "placement": "team",
            "kernel": "auto",
            "own_rows_first": None,
            "ulysses_size": 1,
            "tiled_loss": None,
            "tiled_mlp": None,
            "attention_tile": None,
            "attention_head_chunks": None,
            "placement_shape": None,
            "hybrid_team_sizes": None,
        },
    }


IDENTITY_SCRIPT = """
import json
import megatron.core.transformer.enums as enums
import startrail_megatron.megatron.attention as att
from megatron.training.initialize import parse_args
args = parse_args(None)
print(json.dumps({"same_class": att.AttnMaskType is enums.AttnMaskType}))
"""

IN_PROCESS_DRIVER = """
import json, sys
import startrail_megatron.megatron.attention  # imports megatron-core before the launcher runs
from startrail_megatron.launch import main
main(sys.argv[1:])
import megatron.training.arguments as mlm_arguments
import megatron.training.initialize as mlm_initialize
print(json.dumps({"restored": not hasattr(mlm_arguments.parse_args, "_startrail")
                  and mlm_initialize.parse_args is mlm_arguments.parse_args}))
"""


def test_launcher_in_process_after_megatron_core_was_imported(fake_megatron_lm):
    """megatron is purged for the script's tree: our modules must not keep the old classes;
    the parse_args wrapper is removed when the script is done."""
    script = fake_megatron_lm / "identity.py"
    script.write_text(textwrap.dedent(IDENTITY_SCRIPT))
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(IN_PROCESS_DRIVER), str(script), *ST4],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(fake_megatron_lm),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [json.loads(ln) for ln in res.stdout.strip().splitlines()[-2:]]
    assert lines == [{"same_class": True}, {"restored": True}]


SAME_TREE_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import megatron.training.arguments  # the script's own tree, imported before the launcher
import startrail_megatron.megatron.attention as before
from startrail_megatron.launch import main
argv = list(sys.argv)
main(sys.argv[2:])
print(json.dumps({"kept": sys.modules["startrail_megatron.megatron.attention"] is before,
                  "argv": sys.argv == argv}))
"""


def test_launcher_keeps_modules_of_the_scripts_own_tree(fake_megatron_lm):
    """Nothing is removed from sys.modules when megatron already is the script's tree;
    sys.argv is the caller's again after the script."""
    script = fake_megatron_lm / "identity.py"
    script.write_text(textwrap.dedent(IDENTITY_SCRIPT))
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SAME_TREE_DRIVER), str(fake_megatron_lm)]
        + [str(script), *ST4],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(fake_megatron_lm),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [json.loads(ln) for ln in res.stdout.strip().splitlines()[-2:]]
    assert lines == [{"same_class": True}, {"kept": True, "argv": True}]


def test_launcher_bad_flag_names_it(fake_megatron_lm):
    res = _launch(
        fake_megatron_lm,
        "--context-parallel-size",
        "4",
        "--context-parallel-impl",
        "startrail",
        "--seq-length",
        "60",
    )
    assert res.returncode == 2
    assert "--seq-length 60 must be divisible by 2 * --context-parallel-size = 8" in res.stderr


@pytest.mark.parametrize(
    "name, call",
    [
        ("megatron-lm-core_r0.16.0-to-core_r0.17.0-startrail.patch", "forward_step,"),
        ("megatron-lm-core_r0.18.0-to-main-startrail.patch", "parse_and_validate_args("),
    ],
)
def test_patch_targets_pretrain_gpt(name, call):
    """Each patch chains StarTrail's provider into the call that parses Megatron-LM's
    arguments in its releases (``pretrain(..., forward_step, ...)`` up to core_r0.17.0,
    from core_r0.18.0 ``parse_and_validate_args(...)``); that they apply is checked against the releases'
    checkouts by hand (README, "Upstream Megatron-LM"): no Megatron-LM source is here."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    patch = open(os.path.join(here, "patches", name)).read()
    assert patch.count("+++ b/pretrain_gpt.py") == 1
    assert "+from startrail_megatron.megatron.arguments import extra_args_provider" in patch
    assert "+        extra_args_provider=partial(" in patch
    hunk = patch[patch.index("extra_args_provider=partial(") - 400 :]
    assert call in hunk.split("extra_args_provider=partial(")[0], hunk
