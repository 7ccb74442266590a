"""JUnit XML from case records, for CI dashboards.

Works from the JSON records (the same dicts the JSON Lines file holds), so a single run and a merged
multi-world run write their JUnit the same way. One testsuite per (world size, backend); one
testcase per case, named so that a dashboard can track it across runs; a harness error is an
<error>, a failed check a <failure>; metamorphic groups are testcases too.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Any, Iterable


def _case_name(rec: dict[str, Any]) -> str:
    return f"{rec['scenario']} [{rec['layout']}] {rec['target']} {rec['norm']} {rec['dtype']}"


def _failure_text(rec: dict[str, Any]) -> str:
    lines = [f"{name}: {check['detail']}" for name, check in rec["checks"].items() if not check["passed"]]
    lines += [f"signature: {s}" for s in rec.get("signature", [])]
    lines.append(f"reported {rec['reported']} true {rec['true_norm']} ratio {rec['ratio']}")
    return "\n".join(lines)


def junit_xml(records: Iterable[dict[str, Any]]) -> str:
    suites: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        if rec.get("type") in ("case", "metamorphic"):
            key = f"clipcheck world={rec.get('world_size', '?')} backend={rec.get('backend', '?')}"
            suites[key].append(rec)
    root = ET.Element("testsuites", name="clipcheck")
    for suite_name, recs in suites.items():
        cases = [r for r in recs if r["type"] == "case"]
        suite = ET.SubElement(
            root, "testsuite", name=suite_name, tests=str(len(recs)),
            failures=str(sum(r["verdict"] == "FAIL" for r in cases) + sum(not r["passed"] for r in recs
                                                                          if r["type"] == "metamorphic")),
            errors=str(sum(r["verdict"] == "ERROR" for r in cases)),
            skipped=str(sum(r["verdict"] == "SKIP" for r in cases)),
            time=f"{sum(float(r.get('seconds', 0)) for r in cases):.3f}",
        )
        for rec in recs:
            if rec["type"] == "case":
                tc = ET.SubElement(suite, "testcase", classname=f"clipcheck.{rec['scenario']}",
                                   name=_case_name(rec), time=f"{float(rec['seconds']):.3f}")
                if rec["verdict"] == "FAIL":
                    ET.SubElement(tc, "failure", message="; ".join(
                        n for n, c in rec["checks"].items() if not c["passed"])).text = _failure_text(rec)
                elif rec["verdict"] == "ERROR":
                    ET.SubElement(tc, "error", message="harness error").text = _failure_text(rec)
                elif rec["verdict"] == "SKIP":
                    ET.SubElement(tc, "skipped", message=rec.get("skip_reason") or "skipped")
            else:
                tc = ET.SubElement(suite, "testcase", classname=f"clipcheck.{rec['scenario']}.metamorphic",
                                   name=f"{rec['target']} {rec['norm']} {rec['dtype']} [{rec['invariance_key']}]")
                if not rec["passed"]:
                    ET.SubElement(tc, "failure", message=f"coefficient gap {rec['gap']:.7g}").text = "\n".join(
                        f"{label}: {c}" for label, c in rec["coefficients"].items())
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(path: str, records: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(junit_xml(records))
