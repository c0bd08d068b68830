"""vmon's code-interpreter server, a file per concern: `../code_interpreter.py` runs it (and
says what each file is). `kernel_hooks.py` and `bash_worker.py` are loaded by path in other
processes (each IPython kernel, each bash context's worker): they import only the standard
library, nothing of this package. The bash worker runs with this directory first on
`sys.path`, so no file here is named after a module of the standard library.
"""
