"""Where the test suite's time goes: the per-test times of the last `bash scripts/test.sh` run
(outputs/test-report.xml, pytest's JUnit report) summed per directory, slowest first, with the
`slow` tier apart.

    python bench/suite_times.py [outputs/test-report.xml]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    report = Path(argv[0] if argv else "outputs/test-report.xml")
    if not report.is_file():
        print(f"error: {report}: not there (run bash scripts/test.sh first)", file=sys.stderr)
        return 2
    per_dir: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    slowest = []
    for case in ET.parse(report).iter("testcase"):
        seconds = float(case.get("time", 0))
        module = case.get("classname", "").replace(".", "/")
        directory = "/".join(module.split("/")[:2])
        per_dir[directory] += seconds
        count[directory] += 1
        slowest.append((seconds, f"{module}.py::{case.get('name')}"))
    total = sum(per_dir.values())
    print(f"| directory | tests | seconds | share |\n|---|---|---|---|")
    for directory, seconds in sorted(per_dir.items(), key=lambda kv: -kv[1]):
        print(f"| {directory} | {count[directory]} | {seconds:.0f} | {seconds / total:.0%} |")
    print(f"| total | {sum(count.values())} | {total:.0f} | |\n\nslowest tests:")
    for seconds, name in sorted(slowest, reverse=True)[:15]:
        print(f"  {seconds:6.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
