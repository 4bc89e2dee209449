"""The release gate: the command line, the run over checks (judged against the known issues of
``paritykit.checks.known_issues``), reports and comparisons with an older report, the self-test and
the hypothesis profiles. Nothing below this package imports it."""
