"""``python3 -m epdserve.bench.gpu OUT_DIR [--dry-run]``: the GPU check (``supervisor``)."""

import sys

from epdserve.bench.gpu.supervisor import main

sys.exit(main())
