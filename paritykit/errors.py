"""Exception types shared by every layer.

The split matters to the gate's exit codes: a ParityError or a RankFailure is a
failure of the code under test (exit 1); a HarnessError means paritykit could not
run the check at all (exit 2); UnsupportedByTorchrec is neither: torchrec refused
the configuration, which is reported on its own.
"""


class ParityError(AssertionError):
    """Two paths that should agree do not. The message alone locates the difference."""


class HarnessError(RuntimeError):
    """The harness or environment could not run a check (missing GPU, bad arguments)."""


class UnsupportedByTorchrec(Exception):
    """torchrec rejected a configuration; carries torchrec's own message."""


class RankFailure(RuntimeError):
    """A rank raised, was killed by a signal, or hung. A failure of the code under test."""
