"""``python -m fxq.export.run graph.fxq input.npy``: run a saved integer graph with numpy."""

import sys

from fxq.export.graph import main

if __name__ == "__main__":
    sys.exit(main())
