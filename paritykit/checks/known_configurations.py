"""Known issues matched by configuration, for a user's assertion and the gate alike.

A check that defines known issues registers, per entry id of ``known_issues.toml``, which
configurations show it (a predicate over ``paritykit.harness.configuration.ShardedConfiguration``,
the same one its own known-broken cases and draws use) and the smallest configuration that does (its
standalone reproduction). The check names the module that registers them in its ``CheckEntry``
(``known_configurations``); they are loaded through the check registry, so the engine and the other
checks never import a check to learn its issues.

    matches = matching(exc.configuration, check="sharding")      # entries whose configuration matches
    named_in(exc, "sharding")                                    # the ParityError now names them
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from paritykit.checks import CHECK_PACKAGES, known_issues, load_check
from paritykit.errors import HarnessError, ParityError, RankFailure
from paritykit.harness.configuration import ShardedConfiguration, configurations
from paritykit.harness.versions import installed_versions


@dataclass(frozen=True)
class KnownConfiguration:
    issue: str  # the entry's id in known_issues.toml
    check: str
    applies: Callable[[ShardedConfiguration], bool]
    reproduction: Callable[[], ShardedConfiguration] | None = None


_REGISTERED: dict[str, KnownConfiguration] = {}


def register(issue: str, check: str, applies: Callable[[ShardedConfiguration], bool],
             reproduction: Callable[[], ShardedConfiguration] | None = None) -> None:
    """Called by a check's module at import: configurations that show the entry ``issue``."""
    _REGISTERED[issue] = KnownConfiguration(issue, check, applies, reproduction)


def registered() -> dict[str, KnownConfiguration]:
    """Every check's registrations (their modules imported through the check registry)."""
    for name in CHECK_PACKAGES:
        module = getattr(load_check(name), "known_configurations", "")
        if module:
            importlib.import_module(module)
    return dict(_REGISTERED)


@dataclass(frozen=True)
class Match:
    issue: known_issues.KnownIssue
    standing: str  # applies / elsewhere / fixed (on the installed stack)
    configuration: ShardedConfiguration
    known: KnownConfiguration


def matching(configuration: Any, *, check: str | None = None, path: Path | None = None,
             installed: dict[str, str] | None = None) -> list[Match]:
    """The entries whose configurations include ``configuration`` (one module's, or several): those of
    ``check`` first; of two entries registered with the same predicate (one defect listed by two
    checks), the first."""
    found = registered()
    entries = {issue.id: issue for issue in known_issues.load(path or known_issues.active_file()) if issue.id}
    installed = installed or installed_versions()
    matches: list[Match] = []
    for config in configurations(configuration):
        for known in sorted(found.values(), key=lambda k: (k.check != check, k.issue)):
            issue = entries.get(known.issue)
            if issue is None or not _applies(known, config):
                continue
            if any(m.known.applies is known.applies for m in matches):
                continue  # one defect listed by two checks with the same predicate: named once
            matches.append(Match(issue, issue.standing(installed), config, known))
    return matches


def _applies(known: KnownConfiguration, config: ShardedConfiguration) -> bool:
    try:
        return bool(known.applies(config))
    except Exception:  # noqa: BLE001 - a predicate that cannot read this configuration does not match it
        return False


def describe(match: Match, installed: dict[str, str] | None = None) -> str:
    """What a user's failure is told: the issue, its versions, why, and what to do instead."""
    issue, installed = match.issue, installed or installed_versions()
    versions = f"listed for {issue.listed_for()}; installed {issue.installed_for(installed)}"
    if match.standing == "fixed":
        fixed = ", ".join(f"{package} {version}" for package, version in issue.fixed_in.items())
        head = f"matches known torchrec issue {issue.id!r}, fixed in {fixed} ({versions}): failing here is a regression"
    else:
        head = f"known torchrec issue {issue.id!r} ({versions}): {issue.reason}"
    where = f" (module {match.configuration.fqn!r})" if match.configuration.fqn else ""
    lines = [head + where]
    if issue.workaround and match.standing != "fixed":
        lines.append(f"  what to do instead: {issue.workaround}")
    lines.append(f"  a standalone reproduction (torch and torchrec only): paritykit repro {issue.id}")
    return "\n".join(lines)


def name_known_issues(exc: BaseException, check: str) -> list[Match]:
    """Add the known issues the failure's configuration matches to its message (ParityError and
    RankFailure keep their type and their message, which gains a paragraph)."""
    matches = matching(getattr(exc, "configuration", None), check=check)
    if matches and exc.args and isinstance(exc.args[0], str):
        note = "\n".join(describe(m) for m in matches)
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
        exc.known_issues = [m.issue.id for m in matches]
    return matches


@contextlib.contextmanager
def named_in_failures(check: str) -> Iterator[None]:
    """A public assertion's failure names the known issues its configuration matches."""
    try:
        yield
    except (ParityError, RankFailure) as exc:
        try:
            name_known_issues(exc, check)
        except HarnessError:
            raise
        except Exception as failed:  # noqa: BLE001 - naming is a courtesy: the failure stays what it is
            exc.add_note(f"paritykit could not match the known issues: {type(failed).__name__}: {failed}")
        raise


def reproduction(issue_id: str) -> ShardedConfiguration:
    """The smallest configuration that shows a known issue (HarnessError for an id without one)."""
    found = registered()
    if issue_id not in found or found[issue_id].reproduction is None:
        with_one = sorted(i for i, k in found.items() if k.reproduction is not None)
        raise HarnessError(f"no known issue {issue_id!r} with a reproduction; known: {', '.join(with_one)}")
    return found[issue_id].reproduction()
