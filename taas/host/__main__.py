"""``python -m taas.host``: a job host (see :mod:`taas.host.main`)."""

import sys

from taas.host.main import main

sys.exit(main())
