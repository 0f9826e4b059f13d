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
# The scripts beside the interpreter that runs lit come first: a virtual environment's mplower,
# not another checkout's that happens to be earlier on PATH.
bindir = os.path.dirname(sys.executable)


def tool(name):
    beside = os.path.join(bindir, name)
    return beside if os.path.exists(beside) else shutil.which(name) or beside


mplower = tool("mplower")
filecheck = tool("filecheck")
config.substitutions.append(("mplower", mplower))
config.substitutions.append(("filecheck", filecheck))
config.substitutions.append(("%python", sys.executable))
