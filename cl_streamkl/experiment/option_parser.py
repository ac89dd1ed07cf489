"""The commands' argument parser: options taken whole, and one-line errors that suggest the option meant.

argparse takes a unique prefix of an option as the option by default, so ``--strat streamkl``
would run as ``--strategies streamkl``, and a prefix whole today would change meaning with a
later option. Both ``cl-streamkl run`` and ``cl-streamkl study`` refuse prefixes instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from cl_streamkl.experiment.config_checks import suggest_option


class OptionParser(argparse.ArgumentParser):
    """argparse without abbreviated options, whose errors are one line and exit status 2.

    An unknown option gets the options it begins, else the close ones (its sub-commands'
    options among them). :meth:`report` prints the line; a command overrides it to print its
    own way.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Sub-parsers are made by the parser's own class, so they take options whole too.
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            unknown = message.removeprefix("unrecognized arguments: ").split()[0]
            parsers = [self, *(p for a in self._actions if isinstance(a, argparse._SubParsersAction)
                               for p in a.choices.values())]
            message += suggest_option(unknown.partition("=")[0], [o for p in parsers for o in p._option_string_actions])
        self.report(f"{message} (see {self.prog} --help)")
        sys.exit(2)

    def report(self, message: str) -> None:
        """Print the one-line error ``message``."""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
