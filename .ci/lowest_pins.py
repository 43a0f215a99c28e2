"""Print ``name==version`` for the lower bound pyproject.toml gives each named package.

Used by ``make lowest``: the bounds in pyproject.toml are what the lowest-versions CI step
installs, so a bound that is too low fails there rather than on a user's machine.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
specs = list(project["dependencies"])
for extra in project.get("optional-dependencies", {}).values():
    specs += extra
bounds = {}
for spec in specs:
    m = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*(;.*)?$", spec)
    if m:
        bounds[m.group(1).lower()] = (m.group(2), m.group(3) or "")
missing = [name for name in sys.argv[1:] if name.lower() not in bounds]
if missing:
    sys.exit(f"no '>=' lower bound in pyproject.toml for: {', '.join(missing)}")
for name in sys.argv[1:]:
    version, marker = bounds[name.lower()]
    print(f"{name}=={version}{' ' + marker if marker else ''}")
