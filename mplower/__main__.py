import sys

from mplower.cli import main

sys.exit(main())
