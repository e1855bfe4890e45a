"""The command-line tools, one module each with a `main(argv=None)`: installed as the `iiet-*`
console commands ([project.scripts] in pyproject.toml), and run as `python tools/<name>.py` through
the thin scripts there, which stay because torchrun, the docs, SLURM jobs and tests name them."""
