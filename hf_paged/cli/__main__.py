"""``python -m hf_paged.cli``: the same as the ``hf-paged`` command."""

import sys

from . import main

sys.exit(main())
