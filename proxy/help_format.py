"""How the command lines print their help: each flag's default, and plain text.

``whoseturn``'s own parser (:mod:`proxy.cli`) and the test bench's
(:mod:`loadtests.cli`) both build on :class:`Parser`; it lives here, below both, so
that neither command line imports the other.
"""

from __future__ import annotations

import argparse
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default (unless it has none to show) and plain text:
    no reStructuredText or Markdown backticks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        return super()._expand_help(action).replace("`", "")

    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace("`", ""))


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help (and its subcommands' help) uses
    :class:`HelpFormatter`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
