"""Known failures of the code under test: listed with version ranges, judged on every gate run.

An entry names a check, a case pattern (fnmatch over the case id), the versions it is known to
reproduce on (PEP 440 specifier sets per package: ``"1.8.*"``, ``">=1.8,<1.10"``), optionally the
version that fixed it, a reason and an upstream reference, and optionally the combination it keeps
out of the random draws. On the installed stack an entry *applies* (the installed versions are in
its range), is *fixed* (at or past ``fixed_in``), or is listed *elsewhere* (for other versions, and
not known to be fixed here). A failing case that matches an entry is reported as:

- applies: ``known-issue``; it does not fail the gate;
- elsewhere: ``known-issue`` with the carried-over wording ("known in torchrec 1.8.*, still
  reproduces in torchrec 1.9.2") and what to do (extend the range); ``--strict`` fails on it;
- fixed: a failure, noted as a regression of a fixed issue.

An entry that applies or is listed elsewhere and matched no failing case "no longer reproduces":
a note, and a failure under ``--strict`` (whatever versions the entry lists).

The draws follow the same entries: a combination named by an entry's ``draws`` is kept out of the
random draws wherever the entry applies or is listed elsewhere (it is not known to work there), and
drawn where it is fixed. ``draws`` is (device, module, kernel or sharding type), or ``{ rule = NAME }``
for a combination a check describes itself (the sharding check's known_broken.py rules). The
known-broken cases run every named combination on purpose.

The file is TOML::

    [[issue]]
    check = "cw-stitch"
    case = "known-broken ec * kernel=dense *"
    versions = { torchrec = "1.8.*" }
    fixed_in = { torchrec = "1.10.0" }                             # optional
    draws = { device = "cpu", module = "ec", kernel = "dense" }    # optional; or sharding = "..."
    reason = "a sharded EmbeddingCollection with the dense kernel on CPU fails in its output split"
    reference = "https://github.com/pytorch/torchrec/issues/..."   # optional
    id = "ec-dense-kernel"                                         # optional: names the entry (below)
    workaround = "use the fused kernel (an optimizer in backward)" # optional: what to do instead
    symptom = "output split"                                       # optional: a regex the failure must show

With a ``symptom`` only a failure whose message matches it (``re.search``) is the known issue: the same
case failing another way is a failure, noted as matching the entry's case but not its symptom (a new
defect on a path a known one already breaks must not hide behind it).

An entry with an ``id`` is also matched by configuration (``known_configurations.py``): the check
that defines the issue registers which configurations show it and the smallest one that does, so a
user's failing assertion names the issue, its versions and its workaround, and ``paritykit repro ID``
writes its standalone reproduction.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from paritykit.checks.results import CaseResult
from paritykit.errors import HarnessError
from paritykit.harness.versions import installed_versions

DEFAULT_FILE = Path(__file__).with_name("known_issues.toml")
FIELDS = ("check", "case", "reason", "reference", "versions", "fixed_in", "draws", "id", "workaround", "symptom")
DRAW_KEYS = ("device", "module", "kernel", "sharding", "rule")


def version_matches(installed: str | None, spec: str) -> bool:
    """Whether an installed version is inside ``spec`` ("1.8.*" and "1.9.2" mean ==, "*" any version;
    local tags such as +cpu ignored)."""
    if installed is None:
        return False
    text = spec.strip()
    if text == "*":
        return True
    if text[:1].isdigit():
        text = f"=={text}"
    return SpecifierSet(text).contains(Version(installed).public, prereleases=True)


@dataclass(frozen=True)
class KnownIssue:
    check: str
    case: str
    reason: str
    reference: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    fixed_in: dict[str, str] = field(default_factory=dict)
    draws: dict[str, str] = field(default_factory=dict)
    id: str = ""
    workaround: str = ""
    symptom: str = ""

    def standing(self, installed: dict[str, str]) -> str:
        """"applies", "fixed" or "elsewhere" on a stack with these installed versions."""
        if all(version_matches(installed.get(package), spec) for package, spec in self.versions.items()):
            return "applies"
        if self.fixed_in and all(
            package in installed and Version(Version(installed[package]).public) >= Version(first)
            for package, first in self.fixed_in.items()
        ):
            return "fixed"
        return "elsewhere"

    def matches(self, case: CaseResult) -> bool:
        return self.matches_case(case) and (not self.symptom or re.search(self.symptom, case.message or "") is not None)

    def matches_case(self, case: CaseResult) -> bool:
        """The case pattern alone (whatever the failure shows)."""
        return case.check == self.check and fnmatch.fnmatch(case.case_id, self.case)

    def listed_for(self) -> str:
        return ", ".join(f"{package} {spec}" for package, spec in self.versions.items()) or "every version"

    def installed_for(self, installed: dict[str, str]) -> str:
        packages = list(self.versions) or ["torchrec"]
        return ", ".join(f"{package} {installed.get(package, '(not installed)')}" for package in packages)

    def draw_combination(self) -> tuple[str, str, str] | None:
        """(device, module, kernel or sharding type) this entry keeps out of the draws, if any."""
        if not self.draws or "rule" in self.draws:
            return None
        return (self.draws["device"], self.draws["module"], self.draws.get("kernel") or self.draws["sharding"])


def load(path: Path = DEFAULT_FILE) -> list[KnownIssue]:
    """The entries of a known-issues file (none if it does not exist); a malformed file is a HarnessError naming the entry."""
    if not path.exists():
        return []
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"known-issues file {path} is not valid TOML: {exc}") from exc
    return [_entry(path, index, entry) for index, entry in enumerate(data.get("issue", []))]


def _entry(path: Path, index: int, entry: dict) -> KnownIssue:
    where = f"known-issues file {path}: entry {index}"
    missing = [k for k in ("check", "case", "reason") if k not in entry]
    unknown = sorted(set(entry) - set(FIELDS))
    if missing or unknown:
        raise HarnessError(f"{where} " + "; ".join(filter(None, [f"lacks {missing}" if missing else "", f"has unknown keys {unknown}" if unknown else ""])))
    issue = KnownIssue(**entry)
    try:
        for spec in issue.versions.values():
            version_matches("0", spec)
        for first in issue.fixed_in.values():
            Version(first)
        re.compile(issue.symptom)
    except (InvalidSpecifier, InvalidVersion, re.error) as exc:
        raise HarnessError(f"{where} ({issue.case!r}): {exc}") from exc
    by_rule = set(issue.draws) == {"rule"}
    if issue.draws and not by_rule and (set(issue.draws) - set(DRAW_KEYS) or not {"device", "module"} <= set(issue.draws)
                                        or len({"kernel", "sharding"} & set(issue.draws)) != 1):
        raise HarnessError(f"{where} ({issue.case!r}): draws needs device, module and one of kernel/sharding "
                           f"(or a check's rule alone), got {issue.draws}")
    return issue


# ---------------------------------------------------------------- the file in use, for the draws

_override: list[Path] = []


@contextlib.contextmanager
def use_file(path: Path) -> Iterator[None]:
    """Make ``path`` the known-issues file the draws follow for the block (the gate's --known-issues)."""
    _override.append(Path(path))
    try:
        yield
    finally:
        _override.pop()


def active_file() -> Path:
    return _override[-1] if _override else DEFAULT_FILE


@functools.lru_cache(maxsize=8)
def _load_cached(path: Path, mtime: float) -> tuple[KnownIssue, ...]:
    return tuple(load(path))


def active_issues() -> tuple[KnownIssue, ...]:
    path = active_file()
    return _load_cached(path, path.stat().st_mtime if path.exists() else -1.0)


@functools.lru_cache(maxsize=1)
def _installed() -> dict[str, str]:
    # Versions do not change during a run; the draws ask for them thousands of times.
    return installed_versions()


def kept_out_of_draws(device: str, module: str, name: str) -> str | None:
    """Why (device, module, kernel or sharding type) is kept out of the random draws on this stack, or None."""
    for issue in active_issues():
        if issue.draw_combination() == (device, module, name) and issue.standing(_installed()) != "fixed":
            return issue.reason
    return None


def rule_kept_out(rule: str) -> str | None:
    """Why a check's named rule (a combination it describes itself) is kept out of the draws on this
    stack, or None when no entry names it or the entry is fixed here."""
    for issue in active_issues():
        if issue.draws.get("rule") == rule and issue.standing(_installed()) != "fixed":
            return issue.reason
    return None


class DrawCombinations(Mapping):
    """Every combination a known issue names, whatever its versions: (device, module, name) -> reason."""

    def _combinations(self) -> dict[tuple[str, str, str], str]:
        found = {}
        for issue in active_issues():
            combination = issue.draw_combination()
            if combination is not None:
                found.setdefault(combination, issue.reason)
        return found

    def __getitem__(self, key: tuple[str, str, str]) -> str:
        return self._combinations()[key]

    def __iter__(self) -> Iterator[tuple[str, str, str]]:
        return iter(self._combinations())

    def __len__(self) -> int:
        return len(self._combinations())


# ---------------------------------------------------------------- judging a run's results


@dataclass
class Judgement:
    """A run's results with known failures marked, and what the known-issues file should say instead.

    carried: entries listed for other versions that matched a failure here (extend their range).
    stale: entries that apply or are listed elsewhere and matched no failure (no longer reproduce).
    """

    cases: list[CaseResult]
    carried: list[KnownIssue] = field(default_factory=list)
    stale: list[KnownIssue] = field(default_factory=list)

    def notes(self, installed: dict[str, str], path: Path = DEFAULT_FILE) -> list[str]:
        notes = [
            f"known issue carried over: {issue.check} {issue.case!r} is known in {issue.listed_for()} and still reproduces "
            f"in {issue.installed_for(installed)}: if this release is meant to keep it, extend its versions in {path}"
            for issue in self.carried
        ]
        notes += [
            f"known issue no longer reproduces: {issue.check} {issue.case!r} (listed for {issue.listed_for()}) did not fail "
            f"on {issue.installed_for(installed)}: if it is fixed, set fixed_in (or narrow its versions) in {path}"
            for issue in self.stale
        ]
        return notes

    @property
    def strict_failures(self) -> int:
        return len(self.carried) + len(self.stale)


def apply(cases: list[CaseResult], issues: list[KnownIssue], installed: dict[str, str], *, complete: bool = True) -> Judgement:
    """Mark failures that match an entry; find the entries the file should change.

    ``complete`` False (a ``--case`` run) judges the cases but reports no entry as stale.
    Idempotent: a case marked already still counts as a reproduction.
    """
    standing = {index: issue.standing(installed) for index, issue in enumerate(issues)}
    reproduced: set[int] = set()
    out = []
    not_run = {i for case in cases if case.status == "skip" for i, issue in enumerate(issues) if issue.matches_case(case)}
    for case in cases:
        hit = _matching(case, issues, standing)
        if hit is None:
            out.append(_noted_other_symptom(case, issues))
            continue
        issue = issues[hit]
        if standing[hit] == "fixed":
            note = f"matches known issue {issue.case!r}, fixed in {_fixed_in(issue)}: a regression of a fixed issue"
            out.append(replace(case, message=f"{note}\n{case.message}"))
            continue
        reproduced.add(hit)
        out.append(case if case.status == "known-issue" else _marked(case, issue, standing[hit], installed))
    ran = {case.check for case in cases}
    judged = [i for i, issue in enumerate(issues) if issue.check in ran and standing[i] != "fixed"]
    carried = [issues[i] for i in judged if i in reproduced and standing[i] == "elsewhere"]
    # An entry whose case was not run (a skip says why) is neither reproduced nor stale.
    stale = [issues[i] for i in judged if i not in reproduced and i not in not_run] if complete else []
    return Judgement(out, carried, stale)


def _matching(case: CaseResult, issues: list[KnownIssue], standing: dict[int, str]) -> int | None:
    """The entry a failing case matches: one that applies first, then one listed elsewhere, then a fixed one."""
    if case.status not in ("fail", "known-issue"):
        return None
    for wanted in ("applies", "elsewhere", "fixed"):
        hit = next((i for i, issue in enumerate(issues) if standing[i] == wanted and issue.matches(case)), None)
        if hit is not None:
            return hit
    return None


def _noted_other_symptom(case: CaseResult, issues: list[KnownIssue]) -> CaseResult:
    """A failing case an entry's pattern names, failing otherwise than its symptom: said so, still a failure."""
    if case.status != "fail":
        return case
    other = next((issue for issue in issues if issue.symptom and issue.matches_case(case)), None)
    if other is None or case.message.startswith("fails otherwise than known issue"):
        return case
    note = (f"fails otherwise than known issue {other.id or repr(other.case)}: its failure shows /{other.symptom}/, this one "
            "does not (a new defect on a path the known one breaks)")
    return replace(case, message=f"{note}\n{case.message}")


def _marked(case: CaseResult, issue: KnownIssue, standing: str, installed: dict[str, str]) -> CaseResult:
    reference = f" ({issue.reference})" if issue.reference else ""
    if standing == "applies":
        note = f"known issue: {issue.reason}{reference}"
    else:
        note = (
            f"known issue, carried over: known in {issue.listed_for()}, still reproduces in {issue.installed_for(installed)}: "
            f"{issue.reason}{reference}. If this release is meant to keep it, extend the entry's versions; "
            "`paritykit gate --strict` fails until then"
        )
    return replace(case, status="known-issue", message=f"{note}\n{case.message}")


def _fixed_in(issue: KnownIssue) -> str:
    return ", ".join(f"{package} {version}" for package, version in issue.fixed_in.items())


def supported_on_device(device: str, module: str, name: str) -> bool:
    """False for a (module, sharding type or kernel) pair a known issue keeps out of the draws on the
    installed stack (paritykit/checks/known_issues.toml): other checks avoid such pairs too."""
    return kept_out_of_draws(device, module, name) is None
