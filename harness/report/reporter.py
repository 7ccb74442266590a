"""What rank 0 prints and writes.

Console: one line per case (scenario, layout, target, norm, dtype, reported, true, ratio, verdict),
then, for a failing case, one indented line per failed check and the matching signatures. Notes on
declared-vs-measured placements are printed once per layout variant.

File (``--json PATH``): JSON Lines, one object per case written and flushed as soon as the case is
judged, so a crash loses nothing already measured; metamorphic groups and a summary close the file
(``finish``). Non-finite numbers are written as the strings "nan", "inf", "-inf" to keep every line
valid JSON (``harness.cases.json_numbers``).
"""

from __future__ import annotations

import dataclasses
from typing import IO, Iterable, Mapping

from harness.cases.json_numbers import json_float
from harness.cases.variant import CaseSpec, bound_label
from harness.judge.blame import blame_lines, blame_summary, blame_tolerance, weight_line
from harness.judge.records import CaseResult
from harness.judge.tolerance import NORM_RTOL
from harness.report.failures import metamorphic_spread
from harness.report.finish import finish_run
from harness.report.numbers import format_ratio
from harness.report.record_fields import readings
from harness.report.results_file import ResultsFile
from harness.report.safe_text import lines, one_line
from harness.judge.records import CaseRecord, InFlightRecord, MetamorphicRecord, Record
from harness.cases.target import Finding, Target, finding_for, synthetic


def finding_of(result: CaseResult, target: Target | None) -> Finding | None:
    """The finding a framework adapter's FAIL matches (None for any other verdict, an unexplained
    failure, or a target of the harness's own). On a synthetic layout nobody reaches it, whatever
    the finding says of the layouts users do reach."""
    if target is None or result.verdict != "FAIL":
        return None
    found = finding_for(target.findings, result.case.variant.label, result.case.norm_label)
    why = result.case.variant.synthetic
    return dataclasses.replace(found, reach=synthetic(why)) if found is not None and why else found


def case_json(result: CaseResult, world_size: int, backend: str, target: Target | None = None) -> CaseRecord:
    case = result.case
    finding = finding_of(result, target)
    return {
        "framework": target.framework_version() if target is not None else None,
        "type": "case",
        "index": case.index,
        "scenario": case.scenario,
        "layout": case.variant.label,
        "mesh": dict(case.layout.mesh.axes),
        "target": case.target,
        "norm_type": json_float(case.norm_type),
        "norm": case.norm_label,
        "dtype": case.injection.dtype,
        "max_norm": case.max_norm,
        "clip_ratio": case.clip_ratio,
        "seed": case.injection.seed,
        "world_size": world_size,
        "backend": backend,
        "verdict": result.verdict,
        "true_norm": json_float(result.truth),
        "measured_true_norm": json_float(result.measured_truth),
        "reported": [json_float(v) for v in result.reported],
        "ratio": json_float(result.ratio),
        "tolerance": result.tolerance or NORM_RTOL[case.injection.dtype],
        "coefficient": json_float(result.coefficient),
        "checks": {c.name: {"passed": c.passed, "detail": c.detail} for c in result.checks},
        "signature": result.signature,
        "errors": result.errors,
        "measured_placements": result.placements,
        "declared_mismatches": result.mismatches,
        "invariance_key": case.variant.invariance_key,
        "skip_reason": case.skip,
        "seconds": result.seconds,
        "blame": [{"group": g.group, "params": g.params, "weight": json_float(g.weight), "note": g.note,
                   "line": weight_line(g, blame_tolerance(result.tolerance))} for g in result.blame],
        "blame_note": result.blame_note,
        "blame_rank": result.blame_rank,
        "counting": dict(result.counting),
        "finding": finding.record() if finding is not None else None,
        "synthetic": case.variant.synthetic,
    }


def finding_lines(record: CaseRecord) -> list[str]:
    """What a framework adapter's failing case is, for a person: the finding and who reaches it, and
    its standalone reproduction where someone does; a failure on a synthetic layout says so."""
    if record["verdict"] != "FAIL":
        return []
    finding = record.get("finding")
    if finding is not None:
        lines = [f"finding [{finding['reach']}: {finding['how']}]: {finding['text']}"]
        if finding.get("repro") and finding["reach"] != "synthetic":
            lines.append(f"reproduce without clipcheck: {finding['repro']}")
        return lines
    if record.get("synthetic"):
        return [f"synthetic layout (no known path reaches it: {record['synthetic']})"]
    return ["finding: unexplained (no recorded finding matches this layout)"] if record.get("framework") else []


class Reporter:
    """Rank 0's printer and JSON Lines writer."""

    def __init__(self, out: IO[str], json_path: str | None, world_size: int, backend: str, verbose: bool,
                 targets: Mapping[str, Target] | None = None, junit_path: str | None = None,
                 append: bool = False) -> None:
        self.out = out
        self.junit_path = junit_path
        self.targets = targets or {}
        self.world_size = world_size
        self.backend = backend
        self.verbose = verbose
        self.json = ResultsFile(json_path, append) if json_path else None
        self._noted: set[str] = set()
        self._skips_shown: set[str | None] = set()
        self.records: list[Record] = []

    def _write_json(self, obj: Record) -> None:
        self.records.append(obj)
        if self.json is not None:
            self.json.write(obj)

    def in_flight(self, case: CaseSpec) -> None:
        """Mark ``case`` as started, in the file only: if rank 0 dies in it (plain torchrun has no one
        to record that), the file ends with this marker and no case record, which ``count`` reads as
        a case not judged."""
        if self.json is not None:
            marker: InFlightRecord = {"type": "in_flight", "index": case.index, "scenario": case.scenario,
                                      "layout": case.variant.label, "target": case.target,
                                      "world_size": self.world_size}
            self.json.write(marker)

    def _print(self, line: str = "") -> None:
        print(lines(line), file=self.out, flush=True)

    def header(self, n_cases: int, notes: Iterable[str]) -> None:
        tol = ", ".join(f"{k} {v:g}" for k, v in NORM_RTOL.items())
        self._print(f"clipcheck: {n_cases} cases on {self.world_size} rank(s), backend {self.backend}; "
                    f"norm tolerance (relative, at least) {tol}")
        for note in notes:
            self._print(f"note: {note}")
        self._print(f"{'scenario':<17} {'layout':<52} {'target':<25} {'norm':<5} {'dtype':<5} {'bound':<7} "
                    f"{'reported':<12} {'true':<12} {'ratio':<10} verdict")

    def case(self, result: CaseResult) -> None:
        case = result.case
        label = one_line(case.variant.label)
        if label not in self._noted:
            self._noted.add(label)
            for mismatch in result.mismatches:
                self._print(f"  note [{case.scenario} {label}]: {mismatch}")
            if self.verbose:
                for name, where in result.placements.items():
                    self._print(f"  measured [{label}] {name}: {where}")
        reported = result.reported[0] if result.reported else None
        self._print(
            f"{one_line(case.scenario):<17} {label:<52} {one_line(case.target):<25} {case.norm_label:<5} "
            f"{case.injection.dtype:<5} "
            f"{bound_label(case.clip_ratio, case.max_norm):<7} {format_ratio(reported):<12} "
            f"{format_ratio(result.truth):<12} {format_ratio(result.ratio):<10} {result.verdict}"
        )
        for check in result.failed:
            self._print(f"    {check.name}: {check.detail}".replace("\n", "\n      "))
        if result.verdict == "SKIP":  # the reason (often an install hint) once; its later cases point back to it
            self._print(f"    skipped: {case.skip}" if case.skip not in self._skips_shown else
                        "    skipped: the same reason as above")
            self._skips_shown.add(case.skip)
        record = case_json(result, self.world_size, self.backend, self.targets.get(case.target))
        for line in readings(dict(record)):
            self._print(f"      signature: {line}")
        summary = blame_summary(result)
        if summary and not self.verbose:
            self._print(f"      blame: {summary}")
        for line in blame_lines(result) if self.verbose else ():
            self._print(f"      blame: {line}")
        for line in finding_lines(record):
            self._print(f"      {line}")
        self._write_json(record)

    def metamorphic(self, groups: list[MetamorphicRecord]) -> None:
        if not groups:
            return
        self._print("metamorphic (same unique gradients, different layouts => same coefficient):")
        for g in groups:
            coefficients, gap = g["coefficients"], g["gap"]
            low = min(coefficients, key=coefficients.__getitem__)
            high = max(coefficients, key=coefficients.__getitem__)
            self._print(
                f"  {g['scenario']} {g['target']} {g['norm']} {g['dtype']} {g['bound']} over {len(coefficients)} "
                f"layouts: {metamorphic_spread(g) if not g['passed'] else f'coefficient gap {gap:.7f}'} "
                f"{'PASS' if g['passed'] else 'FAIL'}"
                + ("" if gap == 0 else f"  [{low}: {coefficients[low]:.6f} .. {high}: {coefficients[high]:.6f}]")
            )

    def finish(self, results: list[CaseResult] | None = None) -> int:
        """The run's end (``finish.finish_run``): metamorphic groups over the judged cases, the summary,
        the JSON Lines file closed, JUnit; their lines printed; the exit status. (``results`` is
        accepted for callers that hold them; the records are what count.)"""
        done = finish_run([(self.records, self.backend)], self.json, self.junit_path)
        self.json = None
        self.records += [*done.groups, done.summary]
        self.metamorphic(done.groups)
        if done.counting is not None:
            self._print(done.counting)
        self._print(f"summary: {done.counts.line()}")
        return done.exit_status()

    def close(self) -> str | None:
        """Close the JSON Lines file; why it could not all be written, or None."""
        if self.json is None:
            return None
        self.json.close()
        problem, self.json = self.json.problem(), None
        return problem
