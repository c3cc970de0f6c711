"""``python -m tfdist``: the same as the ``tfdist`` command."""

from tfdist.cli import main

raise SystemExit(main())
