# `python -m tputrain.run [COMMAND] [flags]`: the `tputrain` command, by module name.
#
# Kept because it is documented and baked into job specs: Vertex AI containers and
# `tputrain launch` workers run `python -m tputrain.run --gin_file=...`. The command
# line lives in `tputrain.cli`; this shim is the one library-side module that imports it.
# No docstring on purpose: absl's --help prints the __main__ module's docstring, and
# without one it prints `USAGE: tputrain COMMAND [flags]`, as the console script does.

from tputrain.cli.main import console_main

__all__ = ["console_main"]

if __name__ == "__main__":
    console_main()
