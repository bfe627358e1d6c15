"""Print the README's set-up or test commands, so CI runs exactly what a new user reads.

The commands are the first ```bash block under the README's "## Set up and test" heading:
every line but the last sets up, the last one tests.

    python3 .ci/readme_commands.py setup|test
"""

import re
import sys
from pathlib import Path

text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
section = text.split("## Set up and test", 1)[1]
block = re.search(r"```bash\n(.*?)```", section, re.S)
if block is None:
    sys.exit("README.md: no ```bash block under '## Set up and test'")
lines = [line for line in block.group(1).splitlines() if line.strip()]
if len(lines) < 2 or sys.argv[1:] not in (["setup"], ["test"]):
    sys.exit(
        "usage: readme_commands.py setup|test (README block needs set-up lines and a test line)"
    )
print("\n".join(lines[:-1]) if sys.argv[1] == "setup" else lines[-1])
