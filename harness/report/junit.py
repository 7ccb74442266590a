"""JUnit XML from case records, for CI dashboards.

Works from the JSON records (the same dicts the JSON Lines file holds), so a single run and a merged
multi-world run write their JUnit the same way. One testsuite per (world size, backend); one
testcase per case, named so that a dashboard can track it across runs; a harness error is an
<error>, a failed check a <failure>; metamorphic groups are testcases too.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Iterable

from harness.judge.records import CaseRecord, MetamorphicRecord, Record, case_records, metamorphic_records
from harness.judge.verdicts import count
from harness.report.results_file import write_text
from harness.report.safe_text import lines, one_line


def _case_name(rec: CaseRecord) -> str:
    return one_line(f"{rec['scenario']} [{rec['layout']}] {rec['target']} {rec['norm']} {rec['dtype']}")


def _failure_text(rec: CaseRecord) -> str:
    text = [f"{name}: {check['detail']}" for name, check in rec["checks"].items() if not check["passed"]]
    text += [f"signature: {s}" for s in rec.get("signature", [])]
    text += [f"blame: {b['line']}" for b in rec.get("blame", [])]
    text += [f"blame: {rec['blame_note']}"] if rec.get("blame_note") else []
    text.append(f"reported {rec['reported']} true {rec['true_norm']} ratio {rec['ratio']}")
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
                tc = ET.SubElement(suite, "testcase", classname=one_line(f"clipcheck.{rec['scenario']}"),
                                   name=_case_name(rec), time=f"{float(rec['seconds']):.3f}")
                if rec["verdict"] == "FAIL":
                    ET.SubElement(tc, "failure", message=one_line("; ".join(
                        n for n, c in rec["checks"].items() if not c["passed"]))).text = _failure_text(rec)
                elif rec["verdict"] == "ERROR":
                    ET.SubElement(tc, "error", message="harness error").text = _failure_text(rec)
                elif rec["verdict"] == "SKIP":
                    ET.SubElement(tc, "skipped", message=one_line(rec.get("skip_reason") or "skipped"))
            else:
                tc = ET.SubElement(suite, "testcase", classname=one_line(f"clipcheck.{rec['scenario']}.metamorphic"),
                                   name=one_line(f"{rec['target']} {rec['norm']} {rec['dtype']} "
                                                 f"[{rec['invariance_key']}]"))
                if not rec["passed"]:
                    ET.SubElement(tc, "failure", message=f"coefficient gap {rec['gap']:.7g}").text = lines("\n".join(
                        f"{one_line(label)}: {c}" for label, c in rec["coefficients"].items()))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(path: str, records: Iterable[Record]) -> str | None:
    """Write the JUnit file; why it could not be written (one line), or None."""
    return write_text(path, junit_xml(records))
