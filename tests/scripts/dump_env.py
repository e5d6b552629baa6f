"""A launched script that writes its rank's environment and process facts to <dir>/rank<RANK>.json (for
tests/test_warm_launcher.py: the warm launcher's workers against the real launcher's). With `--imports`, also
what the import-time variables a warm worker applies itself did: datasets' cache paths, sys.path after the
script's folder, whether a sitecustomize ran, torch's recompile log."""

import json
import os
import sys

out = sys.argv[1]
facts = {"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
         "main": sys.modules["__main__"].__file__}
if "--imports" in sys.argv:
    import datasets.config
    import torch._logging._internal

    facts["imports"] = {"datasets_cache": str(datasets.config.HF_DATASETS_CACHE),
                        "downloads": str(datasets.config.DOWNLOADED_DATASETS_PATH),
                        "path1": sys.path[1], "sitecustomized": os.environ.get("SITECUSTOMIZED"),
                        "recompiles_logged": torch._logging._internal.log_state.is_artifact_enabled("recompiles")}
with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(facts, f)
