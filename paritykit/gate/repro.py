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
    """The committed script of a known issue whose reproduction is hand-written."""
    path = REPOSITORY_REPROS / f"{issue_id}.py"
    try:
        return path.read_text()
    except OSError as exc:
        raise HarnessError(f"known issue {issue_id!r} has a hand-written reproduction, repros/{issue_id}.py in paritykit's "
                           f"repository; it is not next to this installation ({exc})") from exc


def write_script(path: Path, configuration: ShardedConfiguration | dict, title: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script_text(configuration, title))
    return path
