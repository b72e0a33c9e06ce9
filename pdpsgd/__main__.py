"""``python -m pdpsgd ...`` is the ``pdpsgd`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
