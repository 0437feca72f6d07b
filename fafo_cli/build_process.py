"""The process that builds one compiled package for another (`Engine.build_elsewhere`): it loads the model again,
reads the packed blocks kept beside the packages, builds the package and exits, so that torch's compiler and what
it keeps (about half a GB) never stay in a chat's or a server's process. Its last line on standard error says why
a build failed."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from . import config as config_mod
    from .api import Engine
    from .compiled.build import CompileError
    from .errors import FafoError, first_line

    job = json.loads((sys.argv[1:] if argv is None else argv)[0])
    try:
        # loaded as the asking process loaded it: its packed blocks installed, its dense matrices freed
        config = config_mod.build(model=job["model"], dtype=job["dtype"], device=job["device"], compile="on",
                                  allow_pickle=job["allow_pickle"], trust_remote_code=job["trust_remote_code"])
        engine = Engine.from_config(config, notify=lambda line: None, load_draft=False)
        if engine.steps_folder != Path(job["folder"]):  # another model or version answers to that name now
            raise FafoError(f"the model in {job['model']} loaded again is not the one whose steps are built")
        engine.compiled.build_here(job["rows"], Path(job["package"]))
    except KeyboardInterrupt:
        return 130
    except (FafoError, CompileError) as error:
        print(first_line(error), file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - the asking process runs eager and says this line
        print(first_line(error, named=True), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
