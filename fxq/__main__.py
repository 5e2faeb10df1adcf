"""``python -m fxq ...``: the ``fxq`` command line (``fxq.cli``)."""

import sys

from fxq.cli import main

if __name__ == "__main__":
    sys.exit(main())
