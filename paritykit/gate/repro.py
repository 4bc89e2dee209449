"""Standalone reproductions: a failing configuration written out as a script that imports torch and
torchrec only, for torchrec's maintainers (``paritykit repro``, and one per finding of a report).

The script is ``repro_template.py`` (a real, runnable module that paritykit never imports) with the
configuration (``paritykit.harness.configuration.ShardedConfiguration.to_json()``) written into its
``CONFIG`` and a title into its docstring. It spawns its own ranks (torch.multiprocessing, gloo),
trains the module sharded and unsharded, and exits 0 when they agree, 1 when they do not or torchrec
raises (a message says where), 2 when it cannot run.
"""

from __future__ import annotations

import pprint
import textwrap
from pathlib import Path

from paritykit.errors import HarnessError
from paritykit.harness.configuration import ShardedConfiguration

TEMPLATE = Path(__file__).with_name("repro_template.py")
# Known issues that are not a sharded configuration (a checkpoint, a pipeline, an op) have hand-written
# scripts with the same exit codes, kept only in the repository's repros/ (next to the package).
REPOSITORY_REPROS = Path(__file__).resolve().parents[2] / "repros"
# The plumbing of the hand-written scripts: one source, a byte-identical copy in each (they import no helper).
PRELUDE = Path(__file__).with_name("repro_prelude.py")
PRELUDE_START = "# --- paritykit repro prelude ("
PRELUDE_END = "# --- end prelude ---"
CONFIG_LINE = "CONFIG: dict = {}  # the configuration, written in when the script is generated"
TITLE_LINE = "TITLE"
EXIT_MATCHES, EXIT_REPRODUCED, EXIT_CANNOT_RUN = 0, 1, 2


def script_text(configuration: ShardedConfiguration | dict, title: str) -> str:
    """The standalone script for ``configuration``, its docstring opening with ``title``."""
    config = configuration if isinstance(configuration, ShardedConfiguration) else ShardedConfiguration.from_json(configuration)
    if config.device != "cpu":
        raise HarnessError(f"a standalone reproduction runs on CPU ranks (gloo); this configuration ran on {config.device}")
    template = TEMPLATE.read_text()
    if CONFIG_LINE not in template or f"\n{TITLE_LINE}\n" not in template:
        raise HarnessError(f"{TEMPLATE} lacks its CONFIG or TITLE line: the reproduction template was edited")
    literal = pprint.pformat(config.to_json(), width=110, sort_dicts=False)
    body = template.replace(CONFIG_LINE, f"CONFIG = {literal}", 1)
    title = title.replace(chr(34) * 3, chr(39) * 3)
    wrapped = "\n".join(textwrap.fill(line, 100) if line else "" for line in title.strip().splitlines())
    return body.replace(f"\n{TITLE_LINE}\n", f"\n{wrapped.replace(chr(92), chr(92) * 2)}\n", 1)


def handwritten_script(issue_id: str) -> str:
    """The committed script of a known issue whose reproduction is hand-written, with the current prelude."""
    path = REPOSITORY_REPROS / f"{issue_id}.py"
    try:
        text = path.read_text()
    except OSError as exc:
        raise HarnessError(f"known issue {issue_id!r} has a hand-written reproduction, repros/{issue_id}.py in paritykit's "
                           f"repository; it is not next to this installation ({exc})") from exc
    return with_prelude(text, path) if PRELUDE_START in text else text


def prelude_text() -> str:
    """The prelude block (its marker lines included) every hand-written script carries."""
    source = PRELUDE.read_text()
    start, end = source.find(PRELUDE_START), source.find(PRELUDE_END)
    if start < 0 or end < start:
        raise HarnessError(f"{PRELUDE} lacks its marker lines {PRELUDE_START!r} ... {PRELUDE_END!r}: it was edited")
    return source[start:end + len(PRELUDE_END)] + "\n"


def prelude_block(text: str, where: Path | str) -> tuple[int, int]:
    """(start, end) of the prelude block in a script's text (its marker lines and the end's newline included)."""
    start, end = text.find(PRELUDE_START), text.find(PRELUDE_END)
    if start < 0 or end < start or text.count(PRELUDE_START) != 1:
        raise HarnessError(f"{where}: no single prelude block ({PRELUDE_START!r} ... {PRELUDE_END!r})")
    return start, end + len(PRELUDE_END) + 1


def with_prelude(text: str, where: Path | str) -> str:
    """The script's text with its prelude block replaced by the current prelude."""
    start, end = prelude_block(text, where)
    return text[:start] + prelude_text() + text[end:]


def refresh_preludes(directory: Path = REPOSITORY_REPROS) -> list[Path]:
    """Rewrites the prelude block of every script in ``directory`` that has one; returns those it changed."""
    changed = []
    for path in sorted(Path(directory).glob("*.py")):
        text = path.read_text()
        if PRELUDE_START in text and with_prelude(text, path) != text:
            path.write_text(with_prelude(text, path))
            changed.append(path)
    return changed


def write_script(path: Path, configuration: ShardedConfiguration | dict, title: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script_text(configuration, title))
    return path
