"""The process that builds one compiled package for another (`Engine.build_elsewhere`): it loads the model again,
reads the packed blocks kept beside the packages, builds the package and exits, so that torch's compiler and what
it keeps (about half a GB) never stay in a chat's or a server's process. Its last line on standard error says why
a build failed."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path


def exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """Stop this process once `parent`, the one that asked for the build, is gone (killed: SIGKILL, the kernel's
    out-of-memory killer): the lock on the package went with it, and a process started since may be building the
    same package, with a copy of the model of its own. (Its pid from the job: gone before this process got here, it
    would not be this one's parent any more.)"""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from . import config as config_mod
    from .api import Engine
    from .compiled.build import CompileError
    from .errors import FafoError, first_line

    job = json.loads((sys.argv[1:] if argv is None else argv)[0])
    exit_with_parent(job["parent"])
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
