"""Command-line options that several commands share, defined once: no command imports
another's command line (``startrail-plan``, ``startrail-bench``, the DiT trainer)."""

from __future__ import annotations

import argparse

from .schedule import OWN_ROWS_FIRST_SETTINGS

__all__ = ["add_own_rows_first"]


def add_own_rows_first(p: argparse.ArgumentParser) -> None:
    """The ``--own-rows-first auto|on|off`` option (``validation.own_rows_first_setting``
    reads its value)."""
    p.add_argument(
        "--own-rows-first",
        choices=tuple(OWN_ROWS_FIRST_SETTINGS),
        default="auto",
        help="StarTrail's first step: its own query rows' calls before the team gathers are "
        "waited on (on), its calls whole (off), or the code's default rule (auto: on only "
        "where the team spans hosts and the gather outweighs the placement; "
        "comm.CommOptions(own_rows_first=))",
    )
