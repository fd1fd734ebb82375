"""`python -m tputrain.cli`: the `tputrain` console script."""

from tputrain.cli.main import console_main

if __name__ == "__main__":
    console_main()
