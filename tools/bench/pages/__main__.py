"""python -m rlfleet.tools.bench.pages [--check]"""

import sys

from rlfleet.tools.bench.pages import main

sys.exit(main())
