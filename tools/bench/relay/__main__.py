"""python -m rlfleet.tools.bench.relay [plot | worker] ..."""

import sys

from rlfleet.tools.bench.relay.run import main

sys.exit(main())
