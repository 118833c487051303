"""``python -m experiments NAME [options]``, from the root of a clone: the same as
``pyro-mpt reproduce NAME [options]``."""

import sys

from pyro_mpt.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", *sys.argv[1:]]))
