"""The `tputrain` command line: a dispatcher and one module per command.

The dependency runs one way: these modules import the library, and no library
module imports them (a test scans for it). `tputrain COMMAND` runs
`tputrain.cli.<command>` (dashes as underscores), whose `console_main()`
defines and parses that command's flags; `tputrain.cli.main` dispatches.
"""

from tputrain.cli.main import SUMMARIES, console_main, overview

__all__ = ["SUMMARIES", "console_main", "overview"]
