"""`python -m hf_eagle31.cli` (and `accelerate launch -m hf_eagle31.cli`): the `hf-eagle31` command, which lives in
the top-level module `hf_eagle31_cli` so that `hf-eagle31 --help` does not import torch."""

import sys

from hf_eagle31_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
