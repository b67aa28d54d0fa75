"""``python -m funcshard inspect | verify | convert`` (see ``funcshard.checkpoint.cli``)."""

import sys

from funcshard.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
