"""The commands that are not a stage, one module per command (or small group of commands); each declares them on a
Typer of its own (`app`), which benchctl.cli gathers under the root."""
