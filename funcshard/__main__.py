"""``python -m funcshard inspect | verify | convert`` (see ``funcshard.cli``)."""

import sys

from funcshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
