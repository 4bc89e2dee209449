"""The self-test: planted bugs and the command that shows which check catches each."""
