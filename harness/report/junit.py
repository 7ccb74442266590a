"""JUnit XML from case records, for CI dashboards.

Works from the JSON records (the same dicts the JSON Lines file holds), so a single run and a merged
multi-world run write their JUnit the same way. One testsuite per (world size, backend); one
testcase per case, named so that a dashboard can track it across runs: the name says scenario,
layout, target, norm, dtype and bound (x0.5 and x2 of one layout are two testcases, never merged into
one), the classname the world and backend, so every (classname, name) of a run is unique. A harness
error is an <error>, a failed check a <failure>, whose text is ``report.failures``' few lines with
the case's replay command; metamorphic groups are testcases too.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Iterable

from harness.judge.records import CaseRecord, MetamorphicRecord, Record, case_records, metamorphic_records
from harness.judge.verdicts import count
from harness.report.failures import case_name, failure_lines
from harness.report.results_file import write_text
from harness.report.safe_text import lines, one_line


def _classname(rec: CaseRecord | MetamorphicRecord, *suffix: str) -> str:
    return one_line(".".join(["clipcheck", f"world{rec['world_size']}", str(rec["backend"]), str(rec["scenario"]),
                              *suffix]))


def _failure_text(rec: CaseRecord) -> str:
    text = [f"reported {rec['reported']} true {rec['true_norm']} ratio {rec['ratio']}", *failure_lines(rec)]
    return lines("\n".join(text))  # XML 1.0 has no place for control characters: escaped, not raw


def junit_xml(records: Iterable[Record]) -> str:
    suites: dict[str, list[CaseRecord | MetamorphicRecord]] = defaultdict(list)
    records = list(records)
    judged: list[CaseRecord | MetamorphicRecord] = [*case_records(records), *metamorphic_records(records)]
    for rec in judged:
        suites[f"clipcheck world={rec['world_size']} backend={rec['backend']}"].append(rec)
    root = ET.Element("testsuites", name="clipcheck")
    for suite_name, recs in suites.items():
        counts = count(recs)
        suite = ET.SubElement(
            root, "testsuite", name=suite_name, tests=str(len(recs)),
            failures=str(counts.failed + counts.metamorphic_failed),
            errors=str(counts.harness_errors + counts.unjudged), skipped=str(counts.skipped),
            time=f"{sum(float(r['seconds']) for r in case_records(recs)):.3f}",
        )
        for rec in recs:
            if rec["type"] == "case":
                tc = ET.SubElement(suite, "testcase", classname=_classname(rec),
                                   name=case_name(rec), time=f"{float(rec['seconds']):.3f}")
                if rec["verdict"] == "FAIL":
                    ET.SubElement(tc, "failure", message=one_line("; ".join(
                        n for n, c in rec["checks"].items() if not c["passed"]))).text = _failure_text(rec)
                elif rec["verdict"] == "ERROR":
                    ET.SubElement(tc, "error", message=one_line("harness error: " + "; ".join(
                        n for n, c in rec["checks"].items() if not c["passed"]))).text = _failure_text(rec)
                elif rec["verdict"] == "SKIP":
                    ET.SubElement(tc, "skipped", message=one_line(rec.get("skip_reason") or "skipped"))
            else:
                tc = ET.SubElement(suite, "testcase", classname=_classname(rec, "metamorphic"),
                                   name=one_line(" ".join(str(p) for p in (rec["target"], rec["norm"], rec["dtype"],
                                                                   rec.get("bound"), f"[{rec['invariance_key']}]")
                                                         if p)))
                if not rec["passed"]:
                    ET.SubElement(tc, "failure", message=f"coefficient gap {rec['gap']:.7g}").text = lines("\n".join(
                        f"{one_line(label)}: {c}" for label, c in rec["coefficients"].items()))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(path: str, records: Iterable[Record]) -> str | None:
    """Write the JUnit file; why it could not be written (one line), or None."""
    return write_text(path, junit_xml(records))
