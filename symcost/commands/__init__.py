"""One module per ``symcost`` command; :data:`symcost.cli.COMMANDS` registers them."""
