import sys
from pathlib import Path

# The project's own modules sit one level up; paritykit's plugin is loaded by its entry point.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
