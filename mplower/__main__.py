import sys

from mplower.cli.main import main

sys.exit(main())
