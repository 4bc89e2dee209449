"""Every check's planted bugs are registered for the tests that apply them by name."""

from paritykit.checks import load_plants

load_plants()
