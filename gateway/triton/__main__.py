"""`python -m gateway.triton`: run tritonserver in the foreground."""

import sys

from .launcher import main

sys.exit(main())
