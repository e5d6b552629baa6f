"""A launched script that writes its rank's environment and process facts to <dir>/rank<RANK>.json (for
tests/test_warm_launcher.py: the warm launcher's workers against the real launcher's)."""

import json
import os
import sys

out = sys.argv[1]
facts = {"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
         "main": sys.modules["__main__"].__file__}
with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(facts, f)
