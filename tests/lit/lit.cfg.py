# ruff: noqa: F821 -- lit runs this file with `config` defined
# lit configuration for mplower's FileCheck tests: `// RUN:` lines run the installed `mplower`
# console script and the Python `filecheck` port, as MLIR and xDSL tests do.
import os
import shutil
import sys

import lit.formats

config.name = "mplower"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".ir", ".mlir"]
config.test_source_root = os.path.dirname(__file__)
config.excludes = ["lit.cfg.py", "Output"]
config.environment["PYTHONIOENCODING"] = "utf-8"
bindir = os.path.dirname(sys.executable)
mplower = shutil.which("mplower") or os.path.join(bindir, "mplower")
filecheck = shutil.which("filecheck") or os.path.join(bindir, "filecheck")
config.substitutions.append(("mplower", mplower))
config.substitutions.append(("filecheck", filecheck))
config.substitutions.append(("%python", sys.executable))
