"""``python -m taas.host FOLDER``: see :mod:`taas.host.main`."""

import sys

from taas.host.main import main

sys.exit(main())
