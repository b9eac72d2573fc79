"""The `kvscope` command: the terminal explorer (alone, or `kvscope tui ...`), else the engine's commands."""
