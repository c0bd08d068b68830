#!/usr/bin/env python3
"""vmon's code-interpreter server: the HTTP API the `e2b-code-interpreter` SDK speaks, on
port 49999. Python contexts are IPython kernels (Debian's `python3-ipykernel`, driven over
ZeroMQ with `jupyter_client`'s message session); bash and JavaScript (Node.js) contexts are
worker processes of this server. Everything else is the Python standard library.

The server is the package `code_interpreter/` beside this file, a file per concern. Run as a
script, this file is `__main__` and its directory is first on `sys.path`, where the package
directory (it has an `__init__.py`) is found before this file of the same name:

- `server.py`: the HTTP API, the access token check, `main`;
- `contexts.py`: the contexts, each made on request or as its language's default;
- `kernels.py`: Python and R contexts, Jupyter kernels driven over ZeroMQ;
- `kernel_hooks.py`: loaded inside each IPython kernel: `e2b/chart`, `e2b/data`, JSON lists
  and dicts, a cell's `env_vars`;
- `workers.py`: bash, JavaScript and TypeScript contexts, worker processes read over pipes;
- `bash_worker.py` and `js_worker.py`: those workers (bash's run as a script, Node.js's as
  `node -e`);
- `common.py`: what several of them use.
"""

from code_interpreter.server import main

if __name__ == "__main__":
    main()
