"""The release gate: the command line, the run over checks, reports, known issues, the self-test
and the hypothesis profiles. Nothing below this package imports it."""
