"""Stage 8, commands: one module per ``symcost`` command (click); :data:`symcost.cli.COMMANDS` registers
them. A command parses its options, runs the passes and hands their results to ``render``."""
